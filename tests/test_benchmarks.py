"""Every benchmark runs, at a tiny size, as a user runs it from a checkout (`python -m benchmarks NAME`),
and prints its figures: none can rot unnoticed again. The two that take minutes even when small,
`internode` and `soak`, are not here: test_hsdp.py asserts the traffic between nodes, and
test_s3_server.py and test_fault_tolerance.py the orphans the soak looks for."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, gpt2_ranks

pytestmark = pytest.mark.slow

NANO = ["model=gpt-nano", "data.block_size=32"]


def bench(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"python -m benchmarks {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_throughput(corpus_file, tmp_path):
    out = bench("throughput", "--steps", "3", "--warmup", "1", "--json", *NANO, "trainer.batch_size=4",
                f"data.path={corpus_file}", f"trainer.run_dir={tmp_path}")
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["tokens_per_s"] > 0 and 0 < figures["mfu"] < 1 and figures["ms_per_step"] > 0


def test_snapshot(corpus_file):
    """On local disk only, without the layouts' comparison: the S3 rows and the uploaders' and
    layouts' comparisons are the same loops over more torchrun jobs, too long for CI."""
    out = bench("snapshot", "--shapes", "gpt-nano", "--configs", "1:ddp", "2:fsdp", "--no-s3", "--layouts", "exchange",
                "--recovery-model", "gpt-nano", "--corpus", str(corpus_file))
    rows = [line for line in out.splitlines() if line.startswith("| gpt-nano |")]
    assert len(rows) == 2 and not any("failed" in r for r in rows), out  # 1 process DDP, 2 ranks FSDP
    m = re.search(r"([\d.]+) s to the first resumed step, resumed from step (\d+), (\d+) steps lost", out)
    assert m and float(m[1]) > 0 and int(m[2]) == 20, out


def test_batching(tmp_path):
    speeches = tmp_path / "speeches.txt"
    speeches.write_text("".join(f"SPEAKER{i % 3}:\n" + "word " * (5 + (i * 37) % 120) + "\n\n" for i in range(300)))
    out = bench("batching", "--steps", "8", "--corpus", str(speeches), "model=gpt-nano", "data.block_size=64",
                "data.documents.token_budget=256", "data.documents.micro_batches_per_step=2",
                "data.documents.pool_size=8")
    assert re.search(r"^random +[\d.]+%", out, re.M) and re.search(r"^length_grouped +[\d.]+%", out, re.M), out
    assert re.search(r"length_grouped vs random: waiting [\d.]+x lower, real-token throughput [\d.]+x", out), out


def test_generate():
    out = bench("generate", "--shape", "gpt-nano", "--new-tokens", "8", "--block-size", "64")
    assert re.search(r"[\d,.]+ tokens/s", out), out


def test_plan():
    out = bench("plan", "--pieces", "2000", "--tokens", "200000", "--block-size", "64", "--token-budget", "512")
    assert "length_grouped" in out and "fixed blocks" in out, out


def test_data(tmp_path):
    out = bench("data", "--ranks-file", gpt2_ranks(), "--sizes", "200KB", "--s3-sizes", "200KB",
                "--prepare-mb", "1", "--repeats", "1", "--steps", "12", "--tmp", str(tmp_path),
                "--model", "model=gpt-nano", "data.block_size=64", "trainer.batch_size=2")
    assert re.search(r"200KB .* local .* MiB", out) and re.search(r"200KB .* s3 .* MiB", out), out
    assert re.search(r"S3 / local: [\d.]+", out), out


def test_goodput(corpus_file, tmp_path):
    # one SIGKILL, tried each second from 1 s after the start until a worker exists (a job lasts longer
    # than its workers' start-up; at 5 s it had once ended before), then the job finishes: the bench's
    # whole path (faults, restarts, the account, the bitwise check) at the least time
    out = bench("goodput", "--model", "gpt-nano", "--kill-every", "1", "--max-kills", "1", "--snapshot-every", "5",
                "--steps", "40", "--corpus", str(corpus_file), "--keep", str(tmp_path), timeout=600)
    faulted = [line for line in out.splitlines() if line.startswith("| 1 s |")]
    assert len(faulted) == 1 and "bitwise equal" in faulted[0], out
    assert int(faulted[0].split("|")[3]) == 1, out  # one SIGKILL, recovered from


def survivors(corpus_file, tmp_path, *only: str) -> list[dict]:
    # 3 replica groups, one SIGKILLed once (in training: the bench waits for a step), 300 steps so that it
    # rejoins before the end (the partition and today's single torchrun are the full bench's)
    out = bench("survivors", "--model", "gpt-nano", "--steps", "300", "--kill-every", "4", "--max-kills", "1",
                "--cut-s", "0", "--kinds", "--no-restart-baseline", "--corpus", str(corpus_file), "--keep", str(tmp_path),
                *only, timeout=600)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # each group in its own CPU share where this machine lets the bench make cgroups (root), else said so
    shares = ("cgroup v1 cpu: ", "cgroup v2 cpu: ", "none (")
    assert all(r["isolation"].startswith(shares) for r in lines), out
    faulted = lines[1]
    assert faulted["faults"] == 1 and faulted["steps_lost_per_fault"]["max"] <= 1, out
    assert faulted["rejoin_s"] is not None and faulted["survivor_gap_s"]["max"] > 0, out
    assert 0 < faulted["goodput"] <= 1, out
    # what the fault cost, against the pace just before it: some time, well under half the run
    assert faulted["fault_cost_s"] is not None and 0 < faulted["lost_to_faults"] < 0.5, out
    return lines


@pytest.mark.long  # (CI: the same faults in tests/scenarios/test_replica_groups.py, their accounting in
# test_report_of_replica_groups.py)
def test_survivors(corpus_file, tmp_path):
    """mingpt's replica groups: the survivors go on, the weights are bitwise the fault-free run's."""
    lines = survivors(corpus_file, tmp_path, "--no-torchft")
    assert [(r["mode"], r["fault"]) for r in lines] == [("replicas", "none"), ("replicas", "SIGKILL every 4 s")], lines
    assert lines[1]["batch_goodput"] == lines[1]["goodput"], lines  # every step trained the whole global batch
    assert lines[1]["final_max_abs_diff"] == 0.0, lines  # the shares summed in order: the fault-free run's weights


@pytest.mark.long
def test_survivors_with_a_warm_spare_per_group(corpus_file, tmp_path):
    """Each group's command twice: the SIGKILL takes the member (the lock's holder), its spare takes the place."""
    lines = survivors(corpus_file, tmp_path, "--no-torchft", "--spares")
    assert [(r["mode"], r["fault"]) for r in lines] == [("replicas", "none"), ("replicas", "SIGKILL every 4 s")], lines
    assert lines[1]["final_max_abs_diff"] == 0.0, lines
    # the returning member built nothing once it took the place: no config, data or model in its rejoin
    assert not {"config", "data_load", "model"} & set(lines[1]["rejoin_parts_s"]), lines


@pytest.mark.long
def test_survivors_through_torchft(corpus_file, tmp_path):
    """The same groups through torchft's Manager."""
    lines = survivors(corpus_file, tmp_path, "--no-replicas")
    assert [(r["mode"], r["fault"]) for r in lines] == [("torchft", "none"), ("torchft", "SIGKILL every 4 s")], lines
    assert 0 < lines[1]["batch_goodput"] < lines[1]["goodput"], lines  # torchft's steps without the lost group
    # torchft trains the survivors' batches only while a group is away: near the fault-free run, not equal
    assert 0 < lines[1]["final_max_abs_diff"] < 1, lines


def test_scale():
    out = bench("scale", "--ranks", "2", "3", "--shapes", "gpt-nano")
    rows = [line for line in out.splitlines() if line.startswith("| gpt-nano |")]
    assert len(rows) == 2, out
    assert re.search(r"gpt-nano restore_collectives: [\d.,]+ \+ [-\d.,]+ \* N", out), out


def test_s3tune():
    out = bench("s3tune", "--mb", "40", "--parts", "16", "--in-flight", "4", "--reads", "64", "--gets", "4",
                "--repeats", "1")
    assert re.search(r"disk \(dd.*\): [\d,]+ MB/s", out), out
    write, read = re.search(r"\| 16 \| ([\d,]+) \| ([\d,]+) \|", out), re.search(r"\| 64 \| ([\d,]+) \|", out)
    assert write and read and all(int(v.replace(",", "")) > 0 for v in (*write.groups(), *read.groups())), out



def test_memory(corpus_file):
    """Two processes: DDP holds every weight on each; TP2 half of each split one, and half of the
    split layers' activations; activation checkpointing keeps fewer activations under both, and no
    other bytes."""
    out = bench("memory", "--model", "gpt-nano", "--nproc", "2", "--layouts", "ddp", "tp2-ddp", "--block", "32",
                "--data", str(corpus_file), "--ac", "--steps", "1", "model.n_head=2")
    rows = {r.split("|")[1].strip(): [float(x) for x in r.split("|")[2:9]] for r in out.splitlines()
            if r.startswith(("| ddp ", "| tp2-ddp "))}
    assert rows.keys() == {"ddp", "tp2-ddp", "ddp +ac", "tp2-ddp +ac"}, out
    (p1, g1, o1, a1, _, _, _), (p2, g2, o2, a2, _, _, _) = rows["ddp"], rows["tp2-ddp"]
    assert p2 < p1 and g2 < g1 and o2 < o1 and 0 < a2 < a1, out
    for layout in ("ddp", "tp2-ddp"):
        plain, ac = rows[layout], rows[f"{layout} +ac"]
        assert ac[:3] == plain[:3] and 0 < ac[3] < plain[3] and ac[5] > 0 and ac[6] > 0, out


def test_pipeline(corpus_file):
    """Two stages against DDP, FSDP and TP2 over 2 processes: each schedule's bubble is measured and set
    beside its theory, 1/3 for 2 stages and 2 micro-batches; a stage sends less than DDP's all-reduce."""
    out = bench("pipeline", "--model", "gpt-nano", "--block", "32", "--micro", "2", "--steps", "1",
                "--data", str(corpus_file), "model.n_head=2")
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in out.splitlines()
            if r.startswith("| ") and not r.startswith(("| layout", "| ---"))}
    assert rows.keys() == {"ddp", "fsdp", "tp2", "pp2 gpipe", "pp2 1f1b"}, out
    for name in ("pp2 gpipe", "pp2 1f1b"):
        _, rate, _, bubble, theory, _, _, sent = rows[name]
        assert theory == "0.333" and 0 < float(bubble) < 1 and float(rate.replace(",", "")) > 0, out
        assert 0 < float(sent) < float(rows["ddp"][7]), out


def test_the_pipeline_bench_compares_sharded_stages_from_4_processes_and_skips_what_cannot_run():
    """The rows of `benchmarks pipeline --nproc 4`: pipelines of 4 stages (1F1B needs 4 micro-batches),
    and 2 stages each sharded over 2 processes by FSDP; none of 4 stages for a model of 3 blocks."""
    from benchmarks.pipeline import layouts

    names = [name for name, _, _ in layouts(4, [4], n_layer=4)]
    assert names == ["ddp", "fsdp", "tp4", "pp4 gpipe", "pp4 1f1b", "pp2 x fsdp2 1f1b", "pp2 x tp2 1f1b"], names
    sharded = dict((name, settings) for name, settings, _ in layouts(4, [4], n_layer=4))["pp2 x fsdp2 1f1b"]
    assert {"trainer.pipeline_parallel=2", "trainer.parallel=fsdp"} <= set(sharded)
    assert [name for name, _, _ in layouts(4, [4], n_layer=3)] == ["ddp", "fsdp", "tp4", "pp2 x fsdp2 1f1b",
                                                                  "pp2 x tp2 1f1b"]
    assert "pp2 x fsdp2 1f1b" not in [name for name, _, _ in layouts(2, [2], n_layer=4)]



# a stand-in for a torchrun agent and its worker (this tests the bench's placement, not mingpt): the agent
# restarts its worker whenever it ends; the worker locks the member's lock (waiting while another holds
# it) and lives on
AGENT = "import subprocess, sys\nwhile True: subprocess.call(sys.argv[1:])"
WORKER = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); " \
         "fcntl.flock(fd, fcntl.LOCK_EX); time.sleep(300)"


def test_with_cores_beside_the_groups_a_spare_runs_there_and_its_member_in_the_groups_share(tmp_path):
    """`survivors --spares --spare-cores C`: the process holding a group's member lock runs in the
    group's CPU share, the group's other process beside it; when the holder dies and the spare takes the
    lock, the spare moves into the group's share and the restarted process out of it."""
    from benchmarks.cpushare import CpuShares
    from benchmarks.survivors import SECRET, Job, lock_holder
    from mingpt.replicas.standby import lock_path
    from mingpt.runtime.trust import job_secret

    lock = lock_path(job_secret({"MINGPT_JOB_SECRET": SECRET}), 0)
    agent = ([sys.executable, "-c", AGENT, sys.executable, "-c", WORKER, str(lock)], dict(os.environ))

    def cgroup(pid: int) -> str:
        """The name of the cgroup whose CPU quota `pid` is under (v1's cpu controller, else v2's)."""
        lines = [line.rstrip().split(":", 2) for line in open(f"/proc/{pid}/cgroup")]
        path = next((p for _, c, p in lines if "cpu" in c.split(",")), None) or next(p for _, c, p in lines if not c)
        return path.rsplit("/", 1)[-1]

    def placed(job: Job, not_member: int | None = None) -> tuple[list[int], tuple[str, str]]:
        """Once the group has a member (a new one, other than `not_member`) and a spare, place them."""
        for _ in range(400):
            pids = job.workers(0)
            if len(pids) == 2 and lock.exists() and pids[0] == lock_holder(lock) and not_member not in pids:
                job.place()
                return pids, (cgroup(pids[0]), cgroup(pids[1]))
            time.sleep(0.05)
        raise AssertionError(f"no member and spare in group 0: {job.workers(0)}")

    with CpuShares(1, beside=0.5) as shares:
        job = Job([agent, agent], tmp_path, shares, groups=1)  # one group, its command twice
        try:
            pids, where = placed(job)
            if not shares.dirs:  # no cgroups here (not root): the bench says so and moves nothing
                assert shares.isolation.startswith("none (") and where[0] == where[1], (shares.isolation, where)
                return
            assert "0.50 cores beside them for the spares" in shares.isolation, shares.isolation
            assert where == ("group0", "groupbeside"), where
            for _ in range(400):  # once the spare waits on the lock
                if job.spares_ready():
                    break
                time.sleep(0.05)
            os.kill(pids[0], signal.SIGKILL)  # the member dies: its spare takes the lock, its agent restarts it
            after, where = placed(job, not_member=pids[0])
            assert after[0] == pids[1] and after[1] not in pids, (pids, after)
            assert where == ("group0", "groupbeside"), where
        finally:
            for a in job.agents:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
            lock.unlink(missing_ok=True)  # (as a run's last holder does)


def test_once_a_group_has_finished_the_run_no_fault_hits_another_groups_restarted_worker(tmp_path):
    """A worker SIGKILLed as the run ends is restarted by its torchrun, finds the run finished and exits;
    on a slow machine its start took as long as the faults' period (10 s), the next fault killed it, and
    the bench killed each restart until its time limit (127 kills in 20 minutes, and no figures)."""
    from benchmarks.survivors import Faults, Job

    agent = [sys.executable, "-c", "import subprocess, sys; subprocess.call(sys.argv[1:])", "sleep", "60"]
    done = ([sys.executable, "-c", "pass"], dict(os.environ))  # group 0: its torchrun ended with the run
    job = Job([done, (agent, dict(os.environ))], tmp_path, None, groups=2)
    try:
        faults = Faults(every=0.01, run_dir=tmp_path)
        faults.training = True  # (past the start-up's steps)
        for _ in range(400):  # group 1's worker up, group 0's agent ended (with 0)
            if job.workers(1) and job.agents[0].poll() == 0:
                break
            time.sleep(0.05)
        worker = job.workers(1)
        assert worker and job.agents[0].returncode == 0, (worker, job.agents[0].returncode)
        assert faults(job, time.time() - 100) == [] and faults.n == 0
        assert job.workers(1) == worker and job.agents[1].poll() is None  # not killed
    finally:
        for a in job.agents[1:]:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
