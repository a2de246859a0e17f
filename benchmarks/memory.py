"""Memory per rank by layout: what each process holds of the parameters, the gradients and the
optimizer state after one real training step (the bytes of its own tensors, DTensor parts as held),
and the activations its forward keeps for the backward (every tensor saved for backward, counted
once by storage, weights whole or gathered left out), for 4 processes on this machine (gloo).

    python -m benchmarks memory [--model gpt2-medium] [--layouts fsdp tp2-fsdp tp4-ddp] [--block 256] [--ac]

The figures are per process, the largest over the ranks; activations are for one micro-batch of one
sequence of --block tokens (they scale with micro-batch x block). With --ac each layout runs again with
trainer.activation_checkpointing=true, and the table adds the process's peak memory (resident, or the
GPU's allocations on CUDA) and the time of a step (the median of --steps after the counted one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS_FILE = REPO.parent / "shared" / "data" / "r50k_base.tiktoken"


def _bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(overrides: list[str], steps: int) -> None:
    """One rank: assemble the run, one step with the saved activations counted, `steps` more timed,
    then report."""
    import torch

    from mingpt.config.compose import compose
    from mingpt.main import assemble
    from mingpt.runtime import distributed
    from mingpt.runtime.console import setup_logging
    from mingpt.runtime.exits import exit_process

    info = distributed.DistInfo.from_env()
    setup_logging(info)
    cfg = compose(overrides)
    distributed.init(info, 600)
    run = assemble(cfg, info)
    # weights are saved for the backward too (a matmul's), and FSDP's gathered weights are views of
    # its all-gather buffers: a saved tensor that shares storage with a parameter of the moment is
    # not an activation
    gpt, seen, saved = run.parallel.gpt, set(), [0]

    def storage(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return getattr(t, "elem", t).untyped_storage()  # a functional collective's result wraps its tensor

    def pack(t):
        key = storage(t).data_ptr()
        if key not in seen and key not in {storage(p).data_ptr() for p in gpt.parameters()}:
            seen.add(key)
            saved[0] += storage(t).nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.train_step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run.train_step()
        times.append(time.perf_counter() - t0)
    cuda = torch.device(info.device).type == "cuda"
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    opt = run.optimizer
    mine = {"parameters": sum(_bytes(p) for p in gpt.parameters()),
            "gradients": sum(_bytes(p.grad) for p in gpt.parameters() if p.grad is not None),
            "optimizer": sum(_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
            "activations": saved[0]}
    every = distributed.all_gather_objects({**mine, "peak": peak, "step_s": statistics.median(times or [0.0])})
    if info.is_rank0:
        print("RESULT " + json.dumps({k: max(m[k] for m in every) for k in every[0]}), flush=True)
    run.close()
    distributed.shutdown()
    exit_process(0, had_process_group=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[2:], int(argv[1]))
        return
    ap = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--layouts", nargs="+", default=["fsdp", "tp2-fsdp", "tp4-ddp"])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--data", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--ac", action="store_true", help="each layout with and without activation checkpointing")
    ap.add_argument("--steps", type=int, default=3, help="steps timed after the counted one (with --ac)")
    ap.add_argument("--micro", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. model.n_layer=2")
    args = ap.parse_args(argv)
    bpe = ["data.tokenizer.kind=bpe", f"data.tokenizer.ranks_file={RANKS_FILE}"] if args.model.startswith("gpt2") else []
    print(f"{args.model}, {args.nproc} processes (gloo), one step of micro-batches of {args.micro} x {args.block} "
          "tokens; MiB per process (the largest rank)")
    extra = " peak | step (s) |" if args.ac else ""
    print(f"| layout | parameters | gradients | optimizer | activations (per micro-batch) | total |{extra}\n"
          f"| --- | --- | --- | --- | --- | --- |{' --- | --- |' if args.ac else ''}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            for ac in (False, True) if args.ac else (False,):
                cfg = layout_config(args, layout, f"{tmp}", bpe) + [f"trainer.activation_checkpointing={ac}"]
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                       "-m", "benchmarks", "memory", "--worker", str(args.steps if args.ac else 0), *cfg]
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    raise SystemExit(f"{layout} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                r = json.loads(lines[-1].removeprefix("RESULT "))
                mb = {k: r[k] / 2**20 for k in ("parameters", "gradients", "optimizer", "activations")}
                row = (f"| {layout}{' +ac' * ac} | {mb['parameters']:.2f} | {mb['gradients']:.2f} | "
                       f"{mb['optimizer']:.2f} | {mb['activations']:.2f} | {sum(mb.values()):.2f} |")
                print(row + (f" {r['peak'] / 2**20:.0f} | {r['step_s']:.3f} |" if args.ac else ""), flush=True)


def layout_config(args, layout: str, tmp: str, bpe: list[str]) -> list[str]:
    """The run's overrides for a layout such as `fsdp` or `tp2-ddp`: one micro-batch per data rank."""
    tp, _, parallel = layout.rpartition("-")
    data_ranks = args.nproc // int(tp[2:] or 1)
    return [f"model={args.model}", *bpe, f"data.path={args.data}", f"data.cache_dir={tmp}/cache",
            f"data.block_size={args.block}", f"trainer.batch_size={data_ranks * args.micro}",
            f"trainer.micro_batch_size={args.micro}", f"trainer.parallel={parallel}",
            f"trainer.tensor_parallel={tp[2:] or 1}", "trainer.eval_every=0", "trainer.progress=false",
            "snapshot.every_steps=0", "snapshot.resume=never", f"trainer.run_dir={tmp}/{layout}", *args.overrides]


if __name__ == "__main__":
    main()
