"""Generation speed with and without the KV cache: greedy tokens/s at a model shape.

    python -m benchmarks generate [--shape gpt2] [--new-tokens 500] [--prompt-tokens 16]

Weights are random (the speed does not depend on them); the vocabulary is GPT-2's. Both paths
must produce the same tokens, which the benchmark checks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mingpt.model.generate import stream
from mingpt.model.gpt import GPT, PRESETS, GPTConfig


def timed(model: GPT, idx: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = torch.cat([idx, *stream(model, idx, new_tokens, temperature=0, use_cache=use_cache)], dim=1)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt2", choices=sorted(PRESETS))
    ap.add_argument("--new-tokens", type=int, default=500)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--no-baseline", action="store_true", help="skip the (slow) run without the cache")
    args = ap.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    model = GPT(GPTConfig(preset=args.shape, vocab_size=50257, block_size=args.block_size)).eval()
    idx = torch.randint(0, 50257, (1, args.prompt_tokens))
    list(stream(model, idx, 4, temperature=0))  # warm-up
    cached, t_cache = timed(model, idx, args.new_tokens, use_cache=True)
    print(f"{args.shape}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, greedy, "
          f"{torch.get_num_threads()} threads")
    print(f"  KV cache:    {t_cache:7.1f} s  {args.new_tokens / t_cache:7.1f} tokens/s")
    if not args.no_baseline:
        plain, t_plain = timed(model, idx, args.new_tokens, use_cache=False)
        print(f"  no cache:    {t_plain:7.1f} s  {args.new_tokens / t_plain:7.1f} tokens/s")
        print(f"  speed-up {t_plain / t_cache:.1f}x; same tokens: {torch.equal(cached, plain)}")
