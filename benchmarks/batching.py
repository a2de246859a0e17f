"""Length-grouped vs random batching on tiny Shakespeare's speeches (char, block 256), 2 ranks.

    python -m benchmarks batching [--steps 40] [--corpus data/input.txt] [hydra overrides...]

Runs the real trainer under `torchrun --standalone --nproc_per_node=2` once per mode with the same
token budget per micro-batch and micro-batches per step, and reads the per-step metrics back.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from mingpt.training.metrics import read_records


def run_mode(mode: str, steps: int, corpus: str, overrides: list[str], tmp: Path) -> dict:
    run_dir = tmp / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mingpt.main",
           "data=shakespeare_speeches", f"data.path={corpus}", f"data.documents.batching={mode}", "model=gpt-micro",
           f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.eval_every=0", "snapshot.every_steps=0",
           "snapshot.resume=never", "trainer.progress=false", f"trainer.run_dir={run_dir}", *overrides]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    recs = read_records(run_dir / "metrics.jsonl")
    recs = [r for r in recs if r["kind"] == "train"][5:]  # skip warm-up steps
    waits = [np.mean([max(r["compute_ms"]) - c for c in r["compute_ms"]]) for r in recs]
    return {
        "pad_frac": float(np.mean([r["pad_frac"] for r in recs])),
        "rank_tokens_max_mean": float(np.mean([r["rank_tokens_max_mean"] for r in recs])),
        "wait_ms": float(np.mean(waits)),
        "step_ms": float(np.mean([r["step_ms"] for r in recs])),
        "real_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in recs])),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks batching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--corpus", default="data/input.txt")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        res = {m: run_mode(m, args.steps, args.corpus, args.overrides, Path(tmp)) for m in ("random", "length_grouped")}
    r, g = res["random"], res["length_grouped"]
    print(f"{'batching':<15} {'padding':>8} {'max/mean tokens':>16} {'wait ms/step':>13} {'ms/step':>8} "
          f"{'real tok/s':>11}")
    for name, x in res.items():
        print(f"{name:<15} {100 * x['pad_frac']:7.1f}% {x['rank_tokens_max_mean']:16.3f} {x['wait_ms']:13.1f} "
              f"{x['step_ms']:8.1f} {x['real_tokens_per_s']:11,.0f}")
    print(f"length_grouped vs random: waiting {r['wait_ms'] / max(g['wait_ms'], 1e-9):.1f}x lower, "
          f"real-token throughput {g['real_tokens_per_s'] / r['real_tokens_per_s']:.2f}x")

