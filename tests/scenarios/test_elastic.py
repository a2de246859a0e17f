"""Two torchrun agents on loopback (--nnodes=1:2): lose a node, go on at WORLD_SIZE=1, take it back."""

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, make_corpus, read_metrics, records, torchrun_env

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

pytestmark = pytest.mark.slow

RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10"
MAX_STEPS = 300
CFG = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.block_size=64",
       "trainer.batch_size=8", "trainer.micro_batch_size=4", "trainer.log_every=1", "trainer.eval_every=0",
       "trainer.progress=false", "optim.warmup_steps=10", f"trainer.max_steps={MAX_STEPS}", "snapshot.every_steps=10"]


# A layout's processes per node and settings. With tensor parallelism each node is one group of 2
# processes splitting every block: a lost node leaves one data replica, the TP degree unchanged. A
# pipeline of 2 stages over 2 nodes of 2 (stage-major: each stage's 2 data ranks on one node): a lost
# node leaves 2 processes, where 2 stages still fit, one data rank. Shorter: a split model is slow on
# this CPU (micro-batches of 2: 1F1B needs 2 a data rank).
SPLIT_STEPS = 100
LAYOUTS = {"ddp": (1, []),
           "tp2": (2, ["trainer.tensor_parallel=2", f"trainer.max_steps={SPLIT_STEPS}"]),
           "pp2": (2, ["trainer.pipeline_parallel=2", "trainer.micro_batch_size=2", f"trainer.max_steps={SPLIT_STEPS}"])}


def agent_cmd(port: int, run_dir: Path, corpus: Path, cache: Path, extra_conf: str = "", layout: str = "ddp",
              launcher: str = "torchrun") -> list[str]:
    """An agent of plain torchrun (c10d), or of the README's `mingpt-torchrun --rdzv_backend=mingpt`."""
    head = ([sys.executable, "-m", "torch.distributed.run", "--rdzv_backend=c10d"] if launcher == "torchrun" else
            [sys.executable, "-m", "mingpt.cli.launch", "--rdzv_backend=mingpt"])
    per_node, settings = LAYOUTS[layout]
    return [*head, "--nnodes=1:2", f"--nproc_per_node={per_node}", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=elastic-test", f"--rdzv_conf={RDZV_CONF}{extra_conf}", "--max-restarts=5", "--monitor-interval=0.5",
            "mingpt/main.py", *CFG, *settings, f"data.path={corpus}", f"data.cache_dir={cache}",
            f"trainer.run_dir={run_dir}"]


def wait_until(cond, procs, timeout=120, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            assert p.poll() is None or p.returncode == 0, f"an agent died while waiting for {what}"
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


SECRET = secrets.token_hex(32)  # the job's, on both nodes (mingpt-torchrun's rendezvous)


def start(cmd, log: Path):
    return subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(MINGPT_JOB_SECRET=SECRET), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at both nodes' size, by layout: (corpus, run directory)."""
    runs = {}

    def run(layout: str):
        if layout not in runs:
            per_node, settings = LAYOUTS[layout]
            tmp = tmp_path_factory.mktemp("elastic-ref")
            corpus = make_corpus(tmp)
            run_dir = tmp / "run"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={2 * per_node}",
                   "mingpt/main.py", *CFG, *settings, f"data.path={corpus}",
                   f"data.cache_dir={tmp / 'cache'}", f"trainer.run_dir={run_dir}"]
            proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=400)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[layout] = corpus, run_dir
        return runs[layout]

    return run


# The agent-hosted store (the other node dies, the store with its host stays) is the case of
# test_hsdp.py's lost node, on two network-namespace nodes; this one keeps the standalone store.
# The README's launcher on one node size, plain torchrun on the other.
@pytest.mark.parametrize("store, layout, launcher", [
    ("standalone", "ddp", "mingpt"), pytest.param("standalone", "tp2", "torchrun", marks=pytest.mark.long),
    pytest.param("standalone", "pp2", "mingpt", marks=pytest.mark.long)], ids=["standalone", "standalone-tp2",
                                                                                "standalone-pp2"])
def test_lose_a_node_continue_at_world_size_1_and_rejoin(reference, tmp_path, store, layout, launcher):
    corpus, ref_dir = reference(layout)
    per_node = LAYOUTS[layout][0]  # processes per node: the world size left with one node
    steps = MAX_STEPS if layout == "ddp" else SPLIT_STEPS
    run_dir, cache, port = tmp_path / "run", tmp_path / "cache", free_port()
    server, extra = None, ""
    if store == "standalone":
        server = subprocess.Popen([sys.executable, "-m", "mingpt.cli.rendezvous", "--host", "127.0.0.1",
                                   "--port", str(port)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        assert "listening" in server.stderr.readline()
        extra = ",is_host=0"
    a = start(agent_cmd(port, run_dir, corpus, cache, extra, layout, launcher), tmp_path / "a.log")
    time.sleep(0.5)
    b = start(agent_cmd(port, run_dir, corpus, cache, extra, layout, launcher), tmp_path / "b.log")
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_until(lambda: any(r.get("world_size") == 2 * per_node and r.get("step", 0) >= 40 for r in records(metrics)),
                   [a, b], what="training at both nodes' world size")
        # kill the node that hosts rank 0 with the standalone store (the rendezvous survives it);
        # with the agent-hosted store, kill the other node (the store dies with its host).
        victim, survivor = (a, b) if store == "standalone" else (b, a)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        t_kill = time.time()
        wait_until(lambda: any(r["kind"] == "resume" and r["world_size"] == per_node for r in records(metrics)),
                   [survivor], what="the survivor resuming at one node's world size")
        resumed_after = time.time() - t_kill
        victim = start(agent_cmd(port, run_dir, corpus, cache, extra, layout, launcher), tmp_path / "c.log")
        t_back = time.time()
        wait_until(lambda: [r["world_size"] for r in records(metrics) if r["kind"] == "resume"][-1:] == [2 * per_node],
                   [survivor, victim], what="the returning node rejoining at both nodes' world size")
        print(f"\n[{store} store, {layout}] resumed at world size {per_node} {resumed_after:.1f} s after the kill; "
              f"back at world size {2 * per_node} {time.time() - t_back:.1f} s after the node returned")
        assert survivor.wait(timeout=240) == 0
        assert victim.wait(timeout=60) == 0
    finally:
        for p in (a, b, server) + ((victim,) if "victim" in locals() else ()):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is not server else p.kill()
    # what a person reads on each node: the survivor says in one line that it lost its peer (no
    # traceback, no Hydra "Error executing job"); a node without rank 0 still says that it joined
    survivor_log = (tmp_path / ("b.log" if store == "standalone" else "a.log")).read_text()
    assert survivor_log.count("lost contact with a peer") == 1, survivor_log[-4000:]
    assert "Error executing job" not in survivor_log and "Traceback" not in survivor_log, survivor_log[-4000:]
    if launcher == "mingpt":  # the returning node restarts the survivor's workers: said so, never a preemption
        assert re.search(r"mingpt-torchrun: a node joined the job \(\S+, agent pid \d+\): restarting the workers on",
                         survivor_log), survivor_log[-4000:]
        assert "torchrun restarts the workers: snapshot of step" in survivor_log, survivor_log[-4000:]
        assert "stopping on SIGTERM" not in survivor_log and "the same command resumes" not in survivor_log
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in "abc")
    assert re.search(rf"\[rank {per_node}/{2 * per_node}\] INFO mingpt.node: \S+ joined", logs), logs[-3000:]
    sizes = [r["world_size"] for r in records(run_dir / "metrics.jsonl") if r["kind"] == "resume"]
    assert sizes == [per_node, 2 * per_node]
    assert resumed_after < 30
    train = read_metrics(run_dir / "metrics.jsonl")
    assert {per_node, 2 * per_node} <= {r["world_size"] for r in train.values()}
    if layout != "ddp":  # one data replica, then two again; every start splits the model in two
        split = {"tp2": "ddp x tensor parallel 2", "pp2": "ddp x pipeline 2 (1f1b)"}[layout]
        starts = re.findall(r"on (\d+) ranks \(([^)]*\)?)\)", logs)
        assert {n for n, _ in starts} == {str(per_node), str(2 * per_node)} and {p for _, p in starts} == {split}, starts
    ref = read_metrics(ref_dir / "metrics.jsonl")
    assert set(train) == set(ref)  # every step logged, max_steps reached
    worst = max(abs(train[s]["loss"] - ref[s]["loss"]) for s in ref)
    assert worst < 2e-3, f"loss curve differs from the uninterrupted run by {worst}"
    # same data consumed, in global units: nothing repeated or skipped
    _, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    _, ref_manifest = read_newest(SnapshotStore(str(ref_dir / "snapshots")))
    assert manifest["step"] == steps and manifest["tokens_seen"] == ref_manifest["tokens_seen"]
