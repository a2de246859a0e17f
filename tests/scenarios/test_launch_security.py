"""The rendezvous and the workers' store against another user of the node: the README's launch
(mingpt-torchrun, --rdzv_backend=mingpt) with a process running as `nobody` that does what a
reviewer did to torch's c10d rendezvous (replace its state with a pickle that runs code)."""

import datetime
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO, as_nobody, forged_state, free_port, make_corpus


def _listening(pids: set[int]) -> list[str]:
    """The local addresses the processes listen on (TCP), read with ss."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def _tree(root: int) -> set[int]:
    pids, found = {root}, True
    while found:
        found = False
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in pids:
                try:
                    ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError):
                    continue
                if ppid in pids:
                    pids.add(int(entry))
                    found = True
    return pids


def _as_nobody(fn):
    """Start fn in a forked child that runs as `nobody`; returns a function that waits for its dict (a
    child still busy `timeout` s after its start is killed: a client of a port that is no store hangs;
    children started together are waited for together)."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    started = time.time()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        result = {}
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # torch's C++ frames of the ports that are no store
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to the parent
            result = {"error": str(e).splitlines()[0][:200]}
        finally:
            os.write(write, json.dumps(result).encode())
            os._exit(0)
    os.close(write)

    def result(timeout: float = 20) -> dict:
        deadline = started + timeout
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.time() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return {"error": "no answer"}
            time.sleep(0.1)
        return json.loads(os.read(read, 65536).decode())
    return result


def _snoop(agent_pid: int) -> dict:
    """What another user learns of the job: the run id on the agent's command line; not its environment."""
    cmdline = open(f"/proc/{agent_pid}/cmdline", "rb").read().split(b"\0")
    found = {"run_id": next(a.split(b"=", 1)[1] for a in cmdline if a.startswith(b"--rdzv_id=")).decode()}
    try:
        open(f"/proc/{agent_pid}/environ", "rb").read()
        found["environ"] = "read"
    except PermissionError:
        found["environ"] = "denied"
    return found


def _plant(port: int, run_id: str, marker) -> dict:
    """Store a code-running pickle as the rendezvous state of run_id (torch's c10d key) at port."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
    for key in (f"torch.rendezvous.{run_id}", "torch.rendezvous.none"):
        store.set(key, forged_state(marker))
    return {"written": 2}


@pytest.mark.slow
def test_another_user_cannot_make_the_documented_launch_run_code(tmp_path):
    """The reviewer's attack on torch's c10d rendezvous, as `nobody`, against the README's two-machine
    command (one node here): the job trains to the end, nothing of the attacker's runs, and every
    socket of the job listens on the endpoint's address only (c10d: every interface)."""
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o755)  # the attacker must not be stopped by a directory it cannot enter
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MINGPT_JOB_SECRET": secrets.token_hex(32)}
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=mingpt",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=run1",
           "--rdzv_conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10",
           "mingpt/main.py", "model=gpt-mini", "trainer.max_steps=30", "trainer.eval_every=0", "trainer.progress=false",
           f"data.path={make_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'cache'}",
           f"trainer.run_dir={tmp_path / 'run'}"]
    log = tmp_path / "job.log"
    with open(log, "w") as fh:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while "training from step" not in log.read_text():  # the stores and the process group are up
            assert time.time() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        addresses = _listening(_tree(job.pid))
        snooped = _as_nobody(lambda: _snoop(job.pid))()
        planting = [_as_nobody(lambda p=a: _plant(int(p.rsplit(":", 1)[1]), snooped["run_id"], marker))
                    for a in addresses]  # all at once, while the job runs
        planted = [result(timeout=10) for result in planting]  # a store answers in ms; gloo's ports never
        job.wait(timeout=300)
        out = log.read_text()
    finally:
        job.kill()
    assert snooped == {"run_id": "run1", "environ": "denied"}, snooped
    # it reached the rendezvous store and the workers' store (the other ports are gloo's)
    assert sum(p.get("written", 0) for p in planted) == 4, planted
    assert job.returncode == 0, out[-3000:]
    assert not marker.exists()
    assert f"127.0.0.1:{port}" in addresses and len(addresses) >= 2, addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses  # never 0.0.0.0:* or [::]:*


def _overwrite_the_store_address(port: int, seconds: float) -> dict:
    """For `seconds`, as another user: list the rendezvous store's keys and overwrite every MASTER_ADDR /
    MASTER_PORT there, and those of round 0 before the agents write them (the state key names them)."""
    deadline, store, written = time.time() + seconds, None, set()
    while time.time() < deadline:
        try:
            store = store or dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
            keys = store.list_keys()
            targets = {k for k in keys if k.endswith(("/MASTER_ADDR", "/MASTER_PORT"))}
            targets |= {f"{k}.0/{name}" for k in keys if k.endswith("/torch.rendezvous.run1")
                        for name in ("MASTER_ADDR", "MASTER_PORT")}
            for key in targets:
                store.set(key, b"not-a-port" if key.endswith("PORT") else b"attacker.invalid")
                written.add(key)
        except Exception:  # noqa: BLE001 - the store is not up yet, or gone with the job that hosted it
            store = None
            time.sleep(0.05)
    return {"written": sorted(k.rsplit("/", 1)[-1] for k in written)}


def _two_agents(tmp_path, port: int, steps: int) -> tuple[list[int], str]:
    """Two agents of one job (two nodes on one machine, rendezvous run1 at `port`) training gpt-mini for
    `steps`: their exit codes and their logs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MINGPT_JOB_SECRET": secrets.token_hex(32)}
    agents, logs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "mingpt.cli.launch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=mingpt",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=run1",
               f"--rdzv_conf=last_call_timeout=1,read_timeout=5,is_host={1 - node}",
               "mingpt/main.py", "model=gpt-mini", f"trainer.max_steps={steps}", "trainer.eval_every=0",
               "trainer.progress=false", "dist.timeout_s=10", f"data.path={make_corpus(tmp_path)}",
               f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={tmp_path / 'run'}"]
        logs.append(tmp_path / f"agent{node}.log")
        with open(logs[-1], "w") as fh:
            agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5 * (1 - node))  # the host's store first
    try:
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    return codes, "\n".join(f"--- agent {n}\n{p.read_text()}" for n, p in enumerate(logs))


@pytest.mark.slow
def test_another_user_overwriting_the_store_address_makes_no_traceback(tmp_path):
    """Two agents (two nodes on one machine); `nobody` finds MASTER_ADDR / MASTER_PORT with list_keys()
    and overwrites them for 15 s, from before the agents write them. torch's agents would take the
    forgery (a ValueError traceback); here it is ignored: each agent goes on or says in one line which
    value was never signed."""
    tmp_path.chmod(0o755)
    port = free_port()
    attack = _as_nobody(lambda: _overwrite_the_store_address(port, 15))
    codes, out = _two_agents(tmp_path, port, steps=2)
    planted = attack(timeout=30)
    assert {"MASTER_ADDR", "MASTER_PORT"} <= set(planted.get("written", [])), planted
    assert "Traceback" not in out and "invalid literal" not in out, out[-4000:]
    assert codes == [0, 0] or "was not signed with this job's secret" in out, (codes, out[-4000:])
    assert "attacker.invalid" not in out and "not-a-port" not in out, out[-4000:]  # never used


@pytest.mark.slow
def test_what_a_run_writes_is_its_users_alone(tmp_path):
    """Under the usual umask 022 a run's snapshots (the weights and the optimizer state), metrics and
    data cache were 0644 in 0755 folders: every user of the node read them. Now the run's umask is
    077 (trainer.readable_by=user), whatever its shell's."""
    shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="mingpt-shared-"))  # a folder every user may enter
    try:
        shared.chmod(0o755)
        run_dir, cache = shared / "run", shared / "cache"
        proc = subprocess.run([sys.executable, "-m", "mingpt.main", "model=gpt-nano", "trainer.max_steps=2",
                               "trainer.eval_every=0", "trainer.progress=false", f"trainer.run_dir={run_dir}",
                               f"data.path={make_corpus(tmp_path)}", f"data.cache_dir={cache}"],
                              cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o022))
        assert proc.returncode == 0, proc.stderr[-3000:]
        written = [p for root in (run_dir, cache) for p in [root, *root.rglob("*")]]
        snapshot = next(p for p in written if p.suffix in (".pt", ".safetensors", ".distcp"))
        assert (run_dir / "metrics.jsonl") in written and any(p.name.startswith("prepared-") for p in written)
        shared_modes = {str(p): oct(p.stat().st_mode & 0o777) for p in written if p.stat().st_mode & 0o077}
        assert shared_modes == {}
        for path in (run_dir / "metrics.jsonl", snapshot):
            read = subprocess.run(["cat", str(path)], preexec_fn=as_nobody(), capture_output=True, text=True)
            assert read.returncode != 0 and "Permission denied" in read.stderr, path
    finally:
        shutil.rmtree(shared)


def _overwrite_the_state(port: int, seconds: float) -> dict:
    """For `seconds`, as another user: find the rendezvous state's key with list_keys() and write into it,
    every 0.3 s, garbage or the first state it read there (a recording of this job)."""
    deadline, store, recorded, written = time.time() + seconds, None, None, 0
    while time.time() < deadline:
        try:
            store = store or dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
            for key in [k for k in store.list_keys() if k.endswith("/torch.rendezvous.run1")]:
                recorded = recorded or store.get(key)
                store.set(key, b"garbage" if written % 2 else recorded)
                written += 1
        except Exception:  # noqa: BLE001 - the store is not up yet, or gone with the job that hosted it
            store = None
        time.sleep(0.3)
    return {"written": written}


@pytest.mark.slow
@pytest.mark.long  # (CI: the signed state's rules in tests/unit/test_rendezvous.py)
def test_another_user_writing_into_the_rendezvous_state_does_not_end_the_job(tmp_path):
    """Two agents; `nobody` writes garbage and a recorded state into the rendezvous state's key for 20 s
    while they start and train. Before, one such write ended the job (exit 1); now it is ignored and
    replaced at the agents' next write, and the job finishes."""
    tmp_path.chmod(0o755)
    port = free_port()
    attack = _as_nobody(lambda: _overwrite_the_state(port, 20))
    codes, out = _two_agents(tmp_path, port, steps=30)
    written = attack(timeout=40).get("written", 0)
    assert codes == [0, 0], (codes, out[-4000:])
    assert written >= 4, (written, out[-4000:])
    assert "Traceback" not in out, out[-4000:]
