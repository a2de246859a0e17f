"""Snapshot figures: blocking time, total save time and load time per model shape and store,
and recovery from a SIGKILL under torchrun.

    python -m mingpt.bench snapshot [--shapes gpt-mini gpt2] [--no-s3] [--no-recovery]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mingpt.model import GPT, GPTConfig
from mingpt.training.optim import build_optimizer
from mingpt.snapshot import Snapshotter, SnapshotStore

VOCAB = {"gpt-mini": 65, "gpt2": 50257}  # char-level Shakespeare and GPT-2 BPE


def training_state(shape: str) -> tuple[dict, float]:
    """The state a trainer would save (model + AdamW after one step), and one step's time."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(preset=shape, vocab_size=VOCAB[shape], block_size=128))
    opt = build_optimizer(model, 1e-3, (0.9, 0.99), 0.1)
    x = torch.randint(0, VOCAB[shape], (32 if shape == "gpt-mini" else 1, 128))
    times = []
    for _ in range(5 if shape == "gpt-mini" else 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": 1}}, step_s


def save_and_load(url: str, state: dict, options: dict | None = None, repeats: int = 3) -> dict:
    """Median blocking and total save time over `repeats` saves, then one load."""
    store = SnapshotStore(url, options)
    snap = Snapshotter(store, keep_last=1)
    totals = []
    for i in range(repeats):
        t0 = time.perf_counter()
        snap.save(i + 1, state, {})
        snap.wait()
        totals.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    store.load_latest()
    load_s = time.perf_counter() - t0
    snap.close()
    return {"blocking_ms": 1000 * sorted(snap.blocking_s)[len(totals) // 2], "save_s": sorted(totals)[len(totals) // 2],
            "load_s": load_s}


def recovery(tmp: Path, corpus: str) -> dict:
    """SIGKILL one worker of a 2-process torchrun job; time until the first resumed step."""
    run_dir = tmp / "recovery"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "mingpt.main", "model=gpt-mini", "trainer.max_steps=100000", "trainer.log_every=1",
           "trainer.eval_every=0", "snapshot.every_steps=20", f"trainer.run_dir={run_dir}", f"data.path={corpus}",
           "trainer.progress=false"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    metrics = run_dir / "metrics.jsonl"

    def records():
        return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []

    try:
        while not any(r.get("step", 0) >= 30 for r in records()):
            time.sleep(0.01)
        killed_at = max(r["step"] for r in records() if r["kind"] == "train")
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        t_kill = time.time()
        os.kill(int(children[-1]), signal.SIGKILL)
        while True:
            recs = records()
            resume = [i for i, r in enumerate(recs) if r["kind"] == "resume"]
            if resume and any(r["kind"] == "train" for r in recs[resume[0]:]):
                first = next(r for r in recs[resume[0]:] if r["kind"] == "train")
                return {"killed_at_step": killed_at, "resumed_from_step": recs[resume[0]]["step"],
                        "steps_lost": killed_at - recs[resume[0]]["step"],
                        "recovery_s": first["time"] - t_kill}
            time.sleep(0.01)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mingpt.bench snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt-mini", "gpt2"], choices=sorted(VOCAB))
    ap.add_argument("--no-s3", action="store_true", help="skip the loopback S3 server (moto)")
    ap.add_argument("--no-recovery", action="store_true", help="skip the SIGKILL recovery measurement")
    ap.add_argument("--corpus", default="data/input.txt", help="corpus for the recovery run")
    args = ap.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    server = None
    if not args.no_s3:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        import s3fs

        s3fs.S3FileSystem().mkdir("bench")
    print(f"{'shape':<9} {'store':<6} {'MB':>7} {'blocking ms':>12} {'% of step':>10} {'save s':>7} {'load s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            state, step_s = training_state(shape)
            mb = sum(t.numel() * t.element_size() for t in _tensors(state)) / 1e6
            stores = [("local", f"{tmp}/{shape}", None)]
            if server is not None:
                stores.append(("s3", f"s3://bench/{shape}", None))
            for name, url, opts in stores:
                r = save_and_load(url, state, opts)
                pct = f"{100 * r['blocking_ms'] / 1000 / step_s:9.1f}%" if shape == "gpt-mini" else f"{'-':>10}"
                print(f"{shape:<9} {name:<6} {mb:7.1f} {r['blocking_ms']:12.1f} {pct} {r['save_s']:7.2f} "
                      f"{r['load_s']:7.2f}", flush=True)
            if shape == "gpt-mini":
                print(f"  (gpt-mini training step, batch 32 x 128, CPU: {1000 * step_s:.0f} ms)")
            del state
        if not args.no_recovery:
            r = recovery(Path(tmp), args.corpus)
            print(f"recovery (2 workers, gpt-mini, snapshot every 20 steps, SIGKILL at step {r['killed_at_step']}): "
                  f"{r['recovery_s']:.1f} s to the first resumed step, resumed from step {r['resumed_from_step']}, "
                  f"{r['steps_lost']} steps lost")
    if server is not None:
        server.stop()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)

