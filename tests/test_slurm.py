"""The sbatch script with stand-in srun / scontrol / hostname that record what they are given."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "slurm" / "train.sbatch"

SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$RECORD/srun.args"
echo "${MINGPT_JOB_SECRET:-}" > "$RECORD/srun.env"
if [[ "${SRUN_MODE:-}" == sleep ]]; then
  trap 'echo TERM > "$RECORD/srun.signal"; exit 75' TERM
  touch "$RECORD/srun.started"
  for _ in $(seq 300); do sleep 0.1; done
fi
"""
SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$RECORD/scontrol.calls"
if [[ "$1 $2" == "show hostnames" ]]; then tr ',' '\\n' <<< "$3"; fi
"""
HOSTNAME = """#!/usr/bin/env bash
echo "$*" >> "$RECORD/hostname.calls"
echo node01
"""

TORCHRUN = """#!/usr/bin/env bash
if [[ "$1" == --new-secret ]]; then exec "$REAL_BIN/mingpt-torchrun" "$@"; fi  # the job's secret: the real one
trap 'echo "$$ TERM" >> "$RECORD/torchrun.calls"; exit 75' TERM  # (before the call is recorded: the tests signal
echo "$$ $*" >> "$RECORD/torchrun.calls"  # once they see it, and a signal between the two killed it unrecorded)
for _ in $(seq "${FAKE_TICKS:-100}"); do sleep 0.05; done
exit "${FAKE_EXIT:-0}"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": SRUN, "scontrol": SCONTROL, "hostname": HOSTNAME}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def slurm_env(bin_dir: Path, record: Path, nodes: list[str], **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MINGPT_JOB_SECRET"))}
    # the scripts make the job's secret with mingpt-torchrun (--new-secret): the one beside this interpreter
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", REAL_BIN=str(Path(sys.executable).parent),
               RECORD=str(record), SLURM_NNODES=str(len(nodes)),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=",".join(nodes), SLURM_GPUS_ON_NODE="8",
               SLURM_SUBMIT_DIR=str(record / "home"), SLURM_JOB_NAME="mingpt", **extra)
    return env


@pytest.mark.parametrize("nodes", [["gpu-a1", "gpu-a2"], ["gpu-b7", "gpu-b8", "gpu-b9", "gpu-c1"]])
def test_torchrun_command_line_for_the_allocation(fake_slurm, tmp_path, nodes):
    proc = subprocess.run(["bash", str(SCRIPT), "model=gpt2", "trainer.max_steps=10"],
                          env=slurm_env(fake_slurm, tmp_path, nodes), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun.args").read_text().split("\0")
    assert args[:4] == ["--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill", "mingpt-torchrun"]
    assert f"--nnodes=1:{len(nodes)}" in args
    assert "--nproc_per_node=8" in args
    assert f"--rdzv_endpoint={nodes[0]}:29500" in args
    assert "--rdzv_id=4242" in args and "--rdzv_backend=mingpt" in args
    assert "--rdzv_conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10" in args
    assert "--max-restarts=3" in args
    assert "--shutdown-timeout=270" in args  # the save gets what SLURM grants, not torchrun's 30 s
    i = args.index("-m")
    assert args[i + 1] == "mingpt.main"
    assert f"trainer.run_dir={tmp_path}/home/runs/mingpt-4242" in args  # this submission's own run
    assert f"snapshot.dir={tmp_path}/home/runs/mingpt-4242/snapshots" in args
    assert args[-3:-1] == ["model=gpt2", "trainer.max_steps=10"]  # user overrides come last
    # every node gets the job's secret through srun's environment, never on a command line
    secret = (tmp_path / "srun.env").read_text().strip()
    assert len(secret) == 64 and not any(secret in a for a in args)


def test_a_new_submission_gets_its_own_run_and_a_named_one_continues(fake_slurm, tmp_path):
    """Two submissions must not continue (or prune) each other's snapshots: each job id is a run;
    a requeue keeps its job id; MINGPT_RUN names a run to continue."""
    dirs = []
    for job, extra in (("101", {}), ("102", {}), ("103", {"MINGPT_RUN": "mingpt-101"})):
        env = slurm_env(fake_slurm, tmp_path, ["n1", "n2"], **extra)
        env["SLURM_JOB_ID"] = job
        proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        dirs.append(next(a for a in (tmp_path / "srun.args").read_text().split("\0") if a.startswith("trainer.run_dir=")))
    assert dirs == [f"trainer.run_dir={tmp_path}/home/runs/mingpt-{n}" for n in (101, 102, 101)]


def test_a_lost_node_does_not_end_the_allocation():
    text = SCRIPT.read_text()
    assert "#SBATCH --no-kill" in text and "srun --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill" in text


def test_usr1_before_the_time_limit_forwards_sigterm_then_requeues(fake_slurm, tmp_path):
    env = slurm_env(fake_slurm, tmp_path, ["n1", "n2"], SRUN_MODE="sleep")
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 20
    while not (tmp_path / "srun.started").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert (tmp_path / "srun.signal").read_text().strip() == "TERM"
    assert "requeue 4242" in (tmp_path / "scontrol.calls").read_text()
    assert "requeueing job 4242" in out


def test_the_node_count_is_written_once():
    text = SCRIPT.read_text()
    assert text.count("#SBATCH --nodes") == 1
    assert "--nnodes=2" not in text and "SLURM_NNODES" in text


@pytest.mark.parametrize("script", ["train.sbatch", "replicas.sbatch"])
def test_shellcheck_passes(script):
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, str(REPO / "slurm" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_replica_groups_one_per_node(fake_slurm, tmp_path):
    """slurm/replicas.sbatch: every node runs its own torchrun of a process per GPU, the same peers (the
    allocation's nodes, in order), its group from SLURM_NODEID on that node, and the secret in the
    environment only."""
    nodes = ["gpu-a1", "gpu-a2", "gpu-a3"]
    proc = subprocess.run(["bash", str(REPO / "slurm" / "replicas.sbatch"), "model=gpt2"],
                          env=slurm_env(fake_slurm, tmp_path, nodes), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun.args").read_text().split("\0")
    assert args[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill"]
    command = args[args.index("-c") + 1]
    assert 'mingpt-torchrun --standalone --nproc_per_node="${SLURM_GPUS_ON_NODE:-1}"' in command  # a process per GPU
    assert '"replicas.group=${SLURM_NODEID}"' in command
    assert "replicas.peers=[gpu-a1:29400,gpu-a2:29400,gpu-a3:29400]" in args
    assert f"trainer.run_dir={tmp_path}/home/runs/mingpt-4242" in args and args[-2] == "model=gpt2"
    # what each node runs: the wrapper, given SLURM_NODEID, names its group first
    (fake_slurm / "mingpt-torchrun").write_text(TORCHRUN)
    (fake_slurm / "mingpt-torchrun").chmod(0o755)
    subprocess.run(["bash", "-c", command, *args[args.index("-c") + 2:-1]], check=True, timeout=30,
                   env={**slurm_env(fake_slurm, tmp_path, nodes), "SLURM_NODEID": "2", "MINGPT_SPARES": "0", "FAKE_TICKS": "0"})
    ran = (tmp_path / "torchrun.calls").read_text()
    assert ran.count("\n") == 1 and "replicas.group=2" in ran and "replicas.peers=[gpu-a1:29400" in ran
    secret = (tmp_path / "srun.env").read_text().strip()
    assert len(secret) == 64 and not any(secret in a for a in args)




def node_command(fake_slurm, tmp_path, **extra) -> tuple[str, list[str]]:
    """The command srun runs on each node, and its arguments, as the replica script hands them over."""
    proc = subprocess.run(["bash", str(REPO / "slurm" / "replicas.sbatch"), "model=gpt2"],
                          env=slurm_env(fake_slurm, tmp_path, ["n1", "n2", "n3"], **extra), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun.args").read_text().split("\0")
    return args[args.index("-c") + 1], args[args.index("-c") + 2:-1]


@pytest.mark.parametrize("fail", [0, 3])
def test_a_warm_spare_per_node_runs_the_groups_command_twice_and_ends_with_it(fake_slurm, tmp_path, fail):
    """MINGPT_SPARES=1: each node starts its group's torchrun twice (the second stands by as the
    member's spare: mingpt/replicas/standby.py), SLURM's SIGTERM reaches both, and the node's task
    exits with the first failure (or 0). Without it, the node's task is its one torchrun (exec)."""
    (fake_slurm / "mingpt-torchrun").write_text(TORCHRUN)
    (fake_slurm / "mingpt-torchrun").chmod(0o755)
    command, args = node_command(fake_slurm, tmp_path, MINGPT_SPARES="1")
    env = {**slurm_env(fake_slurm, tmp_path, ["n1"]), "SLURM_NODEID": "1", "MINGPT_SPARES": "1",
           "FAKE_EXIT": str(fail)}
    quick = {"FAKE_TICKS": "2"}  # where nothing is sent to the stand-ins, they need not last 5 s
    ran = subprocess.run(["bash", "-c", command, *args], env={**env, **quick}, capture_output=True, text=True,
                         timeout=30)
    calls = (tmp_path / "torchrun.calls").read_text().splitlines()
    assert len(calls) == 2 and len({c.split(" ", 1)[1] for c in calls}) == 1 and "replicas.group=1" in calls[0]
    assert ran.returncode == fail
    (tmp_path / "torchrun.calls").unlink()
    node = subprocess.Popen(["bash", "-c", command, *args], env=env)  # SLURM's SIGTERM to the node's task
    deadline = time.time() + 20
    calls = tmp_path / "torchrun.calls"
    while time.time() < deadline and len(calls.read_text().splitlines() if calls.exists() else []) < 2:
        time.sleep(0.05)
    node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=20) == 75
    assert sum(line.endswith(" TERM") for line in (tmp_path / "torchrun.calls").read_text().splitlines()) == 2
    one, args = node_command(fake_slurm, tmp_path)
    assert subprocess.run(["bash", "-c", one, *args], env={**env, **quick, "MINGPT_SPARES": "0"},
                          timeout=30).returncode == fail
    assert len((tmp_path / "torchrun.calls").read_text().splitlines()) == 5  # the two spares' runs, then one


def test_a_spare_setting_other_than_0_or_1_is_refused(fake_slurm, tmp_path):
    proc = subprocess.run(["bash", str(REPO / "slurm" / "replicas.sbatch")],
                          env=slurm_env(fake_slurm, tmp_path, ["n1"], MINGPT_SPARES="yes"), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "MINGPT_SPARES must be 0 (no spare) or 1" in proc.stderr


@pytest.mark.parametrize("script", ["train.sbatch", "replicas.sbatch"])
def test_a_requeue_keeps_its_jobs_secret_and_a_new_job_gets_its_own(fake_slurm, tmp_path, script):
    """A requeue within snapshot.lease_s of a node loss once made a new secret; the job's secret is now
    written once, mode 0600, in the run directory, and a requeue (same job id) reads it back; the new
    launch then waits out the old attempt's lease (mingpt/snapshot/lease.py)."""
    seen = []
    for job in ("101", "101", "102"):
        env = slurm_env(fake_slurm, tmp_path, ["n1", "n2"])
        env["SLURM_JOB_ID"] = job
        proc = subprocess.run(["bash", str(REPO / "slurm" / script)], env=env, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 0, proc.stderr
        seen.append((tmp_path / "srun.env").read_text().strip())
    assert len(seen[0]) == 64 and seen[0] == seen[1] and seen[2] != seen[0]
    kept = tmp_path / "home" / "runs" / "mingpt-101" / "job-101.secret"
    assert kept.read_text().strip() == seen[0] and kept.stat().st_mode & 0o777 == 0o600
