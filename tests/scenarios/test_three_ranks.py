"""Three ranks, where the order of a sum matters: (a + b) + c is not a + (b + c) in floating point.
With two ranks every all-reduce is a + b = b + a and hides it."""

import os
import signal
import subprocess

import pytest
import torch
from conftest import REPO, make_corpus, read_metrics, torchrun_cmd, torchrun_env
from test_fault_tolerance import wait_for_step, workers_of

from mingpt.snapshot import SnapshotStore
from mingpt.training.metrics import read_records

pytestmark = pytest.mark.slow

# 2 layers 128 wide: 1.7 MB of gradients, more than DDP's first bucket (1 MiB), so the buckets that
# DDP builds after its first step differ from that step's single bucket
CFG = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=128", "data.block_size=32",
       "model.dropout=0.1", "trainer.batch_size=12", "trainer.micro_batch_size=4", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.progress=false", "optim.warmup_steps=5", "trainer.max_steps=40",
       "snapshot.every_steps=10"]


def test_a_sigkilled_worker_of_three_resumes_bitwise(tmp_path):
    corpus = make_corpus(tmp_path)
    runs = {}
    for name in ("ref", "killed"):
        run_dir = tmp_path / name
        cmd = torchrun_cmd(3, "mingpt/main.py", *CFG, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                           f"trainer.run_dir={run_dir}", max_restarts=1)
        agent = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        if name == "killed":
            wait_for_step(run_dir / "metrics.jsonl", 25, agent)
            os.kill(workers_of(agent.pid)[2], signal.SIGKILL)
        out, _ = agent.communicate(timeout=300)
        assert agent.returncode == 0, out[-4000:]
        state, manifest = SnapshotStore(str(run_dir / "snapshots")).load_latest()
        runs[name] = (state["model"], {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items()})
    assert [r["step"] for r in read_records(tmp_path / "killed" / "metrics.jsonl") if r["kind"] == "resume"] == [20]
    (ref, ref_losses), (got, losses) = runs["ref"], runs["killed"]
    assert losses == ref_losses
    for name, w in ref.items():
        assert torch.equal(got[name], w), (name, (got[name] - w).abs().max().item())
