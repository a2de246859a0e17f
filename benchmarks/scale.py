"""Snapshot costs per rank against the world size: a DDP job of 2 to 32 ranks (torchrun on this
machine, gloo) saves and restores a model's full training state; per rank, the manifest's bytes, the
collectives and bytes of the save (its commit) and of the restore, and the wall times.

    python -m benchmarks scale [--ranks 2 4 8 16 32] [--shapes gpt-nano gpt2-tensors]

gpt2-tensors has gpt2's number of tensors (12 blocks; 592 with the optimizer's) at small widths,
so that the count of tensors is real while 32 processes fit on one machine. The last lines fit
each figure to a + b * N and project it to 1,024 and 8,192 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import die_with_bench

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("manifest_bytes", "save_collectives", "save_bytes", "restore_collectives")


def run(shape: str, ranks: int, url: str) -> list[dict]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "benchmarks.scale_worker", shape, url]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
                          preexec_fn=die_with_bench)
    if proc.returncode != 0:
        raise SystemExit(f"{shape} at {ranks} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit(ns: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares a + b * n (the restore's bytes are left out: about the state's, at any N)."""
    mn, my = statistics.fmean(ns), statistics.fmean(ys)
    var = sum((n - mn) ** 2 for n in ns)
    b = sum((n - mn) * (y - my) for n, y in zip(ns, ys)) / var if var else 0.0
    return my - b * mn, b


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16, 32])
    ap.add_argument("--shapes", nargs="+", default=["gpt-nano", "gpt2-tensors"])
    args = ap.parse_args(argv)
    print(f"DDP, torchrun --standalone, gloo, {os.cpu_count()} CPUs; per rank (worst rank; the committer for the save)")
    print("| shape | tensors | state KB | ranks | manifest KB | save collectives | save KB moved | save s | "
          "restore collectives | restore KB moved | restore s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for shape in args.shapes:
        rows = {}
        for n in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                ranks = run(shape, n, f"{tmp}/snapshots")
            worst = {k: max(r[k] for r in ranks) for k in (*FIGURES, "restore_bytes", "save_s", "restore_s")}
            rows[n] = worst
            r0 = ranks[0]
            print(f"| {shape} | {r0['tensors']} | {r0['state_bytes'] / 1024:,.0f} | {n} | "
                  f"{worst['manifest_bytes'] / 1024:,.1f} | {worst['save_collectives']} | "
                  f"{worst['save_bytes'] / 1024:,.1f} | {worst['save_s']:.2f} | {worst['restore_collectives']} | "
                  f"{worst['restore_bytes'] / 1024:,.1f} | {worst['restore_s']:.2f} |", flush=True)
        ns = sorted(rows)
        for key in FIGURES:
            a, b = fit(ns, [rows[n][key] for n in ns])
            print(f"  {shape} {key}: {a:,.0f} + {b:,.1f} * N  ->  N=1,024: {a + b * 1024:,.0f}, "
                  f"N=8,192: {a + b * 8192:,.0f}", flush=True)


if __name__ == "__main__":
    main()
