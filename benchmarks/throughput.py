"""Training throughput: tokens/s, ms per step and MFU, the medians over a number of steps after warm-up.

    python -m benchmarks throughput model=gpt-micro data.block_size=64 trainer.batch_size=12 trainer.micro_batch_size=12
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 -m benchmarks --steps 100 model=gpt-micro ...

Arguments after the options are Hydra overrides of conf/config.yaml. Nothing is saved or resumed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from mingpt.config.compose import compose
from mingpt.main import assemble
from mingpt.runtime import distributed
from mingpt.runtime.console import setup_logging
from mingpt.runtime.exits import exit_process
from mingpt.training.metrics import peak_flops


def throughput(overrides: list[str], steps: int, warmup: int) -> dict:
    info = distributed.DistInfo.from_env()
    setup_logging(info)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose([f"trainer.run_dir={tmp}", "snapshot.resume=never", "trainer.progress=false", *overrides])
        distributed.init(info, cfg.dist.timeout_s, cfg.trainer.threads, cfg.trainer.deterministic)
        trainer = None
        try:
            trainer = assemble(cfg, info)
            for _ in range(warmup):
                trainer.train_step()
                trainer.progress.step += 1
            distributed.barrier()
            times, rates = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                stats = trainer.train_step()
                trainer.progress.step += 1
                # each step timed whole (the device drained): the median leaves out a step that
                # recompiled (torch.compile meets the epoch's short last batch once) or hit a save
                loss = distributed.all_reduce_sum(stats.loss_sum.clone()).item() / stats.tokens
                times.append(time.perf_counter() - t0)
                rates.append(stats.tokens / times[-1])
            distributed.barrier()
            flops = trainer.parallel.gpt.flops_per_token(cfg.data.block_size)
            peak = peak_flops(cfg.trainer, info, trainer.device)
        finally:
            if trainer is not None:
                trainer.close()
            distributed.shutdown()
    dt, tok_s = statistics.median(times), statistics.median(rates)  # tokens: of each step (an epoch's last is short)
    return {
        "config": " ".join(overrides) or "(defaults)",
        "world_size": info.world_size,
        "threads_per_process": torch.get_num_threads(),
        "steps": steps,
        "ms_per_step": round(1000 * dt, 2),
        "tokens_per_s": round(tok_s),
        "mfu": round(tok_s * flops / peak, 4),
        "last_loss": round(loss, 4),
        "is_rank0": info.is_rank0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="timed steps (default 50)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt-micro trainer.compile=true")
    args = ap.parse_args(argv)
    res = throughput(args.overrides, args.steps, args.warmup)
    if res.pop("is_rank0"):
        if args.json:
            print(json.dumps(res))
        else:
            print(f"{res['config']}\n  world size {res['world_size']} x {res['threads_per_process']} threads: "
                  f"{res['ms_per_step']:.1f} ms/step, {res['tokens_per_s']:,} tokens/s, MFU {100 * res['mfu']:.1f}%")
    exit_process(0, had_process_group=res["world_size"] > 1)

