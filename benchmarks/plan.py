"""Epoch planning at corpus scale: the samplers' time and memory for one epoch's plan.

    python -m benchmarks plan [--pieces 10000000] [--tokens 1000000000] [--block-size 1024]

Synthetic document lengths (log-normal, like web text, capped at the block size) stand in for a
prepared corpus; nothing is read from disk. For each sampler: the time to plan an epoch, the time
for a resumed run to reach its position and hand out a step, and the plan's peak memory.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from mingpt.data.samplers import LengthGroupedSampler, StreamSampler


def measure(make) -> tuple[float, float, float]:
    """(seconds to plan an epoch and take a step, seconds for a resumed sampler to reach its position
    and take a step, peak MiB while planning)."""
    t0 = time.perf_counter()
    sampler = make()
    sampler.next_step()
    plan_s = time.perf_counter() - t0
    for _ in range(3):
        sampler.next_step()
    state = sampler.state_dict()
    t0 = time.perf_counter()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.next_step()
    resume_s = time.perf_counter() - t0
    tracemalloc.start()  # numpy reports its allocations to tracemalloc; measured apart, as it slows them
    make().next_step()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return plan_s, resume_s, peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", type=int, default=10_000_000, help="document pieces (length-grouped sampler)")
    ap.add_argument("--tokens", type=int, default=1_000_000_000, help="corpus tokens (fixed-block sampler)")
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch (documents)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, args.pieces), 2, args.block_size).astype(np.int64)
    blocks = (args.tokens - 1) // args.block_size
    cases = [
        (f"fixed blocks, {blocks:,} blocks of {args.block_size}", lambda: StreamSampler(blocks, 512, 0, 16)),
        (f"length_grouped, {args.pieces:,} pieces",
         lambda: LengthGroupedSampler(lengths, args.token_budget, 8, 0)),
        (f"random, {args.pieces:,} pieces",
         lambda: LengthGroupedSampler(lengths, args.token_budget, 8, 0, mode="random")),
    ]
    print(f"{'sampler':<44} {'plan s':>7} {'resume s':>9} {'peak MiB':>9}")
    for name, make in cases:
        plan_s, resume_s, peak = measure(make)
        print(f"{name:<44} {plan_s:7.2f} {resume_s:9.2f} {peak:9.0f}")


if __name__ == "__main__":
    main()
