"""Pipeline parallelism against the other layouts at one model and one global batch, on this machine
(gloo): per schedule and micro-batch count, the bubble (the share of a step a stage waits) against
its theory (p-1)/(m+p-1) (interleaved, v stages per process: (p-1)/(v m+p-1)), tokens/s against DDP,
the bytes a process holds (parameters, gradients, optimizer state; the activations kept for the
backward at their peak) against DDP, FSDP and tensor parallelism, and the bytes each step sends
between stages against what DDP and FSDP send.

    python -m benchmarks pipeline [--model gpt-mini] [--nproc 2] [--micro 2 4 8] [--block 64] [--steps 4]
        [--layouts ddp,fsdp,tp,pp]

Each row is one torchrun job of --nproc processes (pipelines of --nproc stages; with 4 or more, also
pipelines of half as many stages, each stage sharded over 2 processes by FSDP, or its blocks split
over 2 by tensor parallelism; the other layouts over
as many processes), --warmup steps untimed, then --steps timed. A stage is busy while it runs a
forward or a backward of the schedule (PipelineStage.forward_one_chunk / backward_one_chunk, timed);
the bubble is 1 - busy / the schedule's step time (its sends and receives, waits and Python included),
the mean over the stages. Activations: the bytes saved for the
backward by one micro-batch (every tensor saved, counted once by storage, weights left out), times
the micro-batches a stage holds at once: GPipe all m, 1F1B at most p, interleaved its warm-up
(stage 0's count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(steps: int, warmup: int, overrides: list[str]) -> None:
    """One process: assemble the run, train warmup + steps, report its figures (rank 0 prints them all)."""
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from mingpt.config.compose import compose
    from mingpt.main import assemble, setup_logging
    from mingpt.runtime import distributed
    from mingpt.runtime.exits import exit_process

    busy, scheduled = [0.0], [0.0]

    def timed(fn, into):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into[0] += time.perf_counter() - t0
        return wrapper

    PipelineStage.forward_one_chunk = timed(PipelineStage.forward_one_chunk, busy)
    PipelineStage.backward_one_chunk = timed(PipelineStage.backward_one_chunk, busy)
    PipelineScheduleSingle.step = timed(PipelineScheduleSingle.step, scheduled)
    PipelineScheduleMulti.step = timed(PipelineScheduleMulti.step, scheduled)
    info = distributed.DistInfo.from_env()
    setup_logging(info)
    cfg = compose(overrides)
    distributed.init(info, 600)
    run = assemble(cfg, info)
    par, held = run.parallel, [p for p in run.parallel.local.parameters() if not p.is_meta]
    seen, saved = set(), [0]
    params = {p.untyped_storage().data_ptr() for p in held if not hasattr(p, "to_local")}

    def pack(t):
        t0 = t.to_local() if hasattr(t, "to_local") else t
        s = getattr(t0, "elem", t0).untyped_storage()
        if s.data_ptr() not in seen and s.data_ptr() not in params:
            seen.add(s.data_ptr())
            saved[0] += s.nbytes()
        return t

    for _ in range(warmup):
        run.train_step()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # one step's saved tensors
        run.train_step()
    sent0, busy[0], scheduled[0] = par.pp.sent_bytes if par.pp else 0, 0.0, 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        run.train_step()
    wall = time.perf_counter() - t0
    tokens = cfg.trainer.batch_size * cfg.data.block_size * steps
    mine = {"wall": wall, "busy": busy[0], "scheduled": scheduled[0], "tokens_per_s": tokens / wall,
            "parameters": sum(_bytes(p) for p in held), "gradients": sum(_bytes(p.grad) for p in held if p.grad is not None),
            "optimizer": sum(_bytes(v) for st in run.optimizer.state.values() for v in st.values() if torch.is_tensor(v)),
            "saved_per_step": saved[0], "sent_per_step": ((par.pp.sent_bytes if par.pp else 0) - sent0) / steps,
            "grad_bytes": sum(_bytes(p.grad) for p in held if p.grad is not None)}
    every = distributed.all_gather_objects(mine)
    if info.is_rank0:
        print("RESULT " + json.dumps(every), flush=True)
    run.close()
    distributed.shutdown()
    exit_process(0, had_process_group=True)


def layouts(nproc: int, micro: list[int], n_layer: int) -> list[tuple[str, list[str], int]]:
    """(row name, its settings, micro-batches of the pipeline): FSDP and TP at the smallest count, then
    at each count DDP (at the same global batch) and each schedule."""
    m0 = micro[0]
    rows = []
    for m in micro:
        rows.append(("ddp", [], m))
        if m == m0:
            rows += [("fsdp", ["trainer.parallel=fsdp"], m0), (f"tp{nproc}", [f"trainer.tensor_parallel={nproc}"], m0)]
        for schedule in ("gpipe", "1f1b", "interleaved"):
            if n_layer < nproc or (schedule == "1f1b" and m < nproc) or (schedule == "interleaved" and n_layer < 2 * nproc):
                continue
            rows.append((f"pp{nproc} {schedule}", [f"trainer.pipeline_parallel={nproc}",
                                                   f"trainer.pipeline_schedule={schedule}"], m))
        if m == m0 and nproc >= 4 and nproc % 2 == 0 and m0 >= nproc:  # half the stages, each over 2 processes
            rows.append((f"pp{nproc // 2} x fsdp2 1f1b", [f"trainer.pipeline_parallel={nproc // 2}",
                                                         "trainer.parallel=fsdp", "trainer.pipeline_schedule=1f1b"], m0))
            rows.append((f"pp{nproc // 2} x tp2 1f1b", [f"trainer.pipeline_parallel={nproc // 2}",
                                                       "trainer.tensor_parallel=2", "trainer.pipeline_schedule=1f1b"], m0))
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]), argv[3:])
        return
    ap = argparse.ArgumentParser(prog="python -m benchmarks pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8], help="micro-batches per step")
    ap.add_argument("--micro-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--data", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--layouts", default="ddp,fsdp,tp,pp", help="which rows, comma-separated (pp: every schedule)")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. model.n_layer=4")
    args = ap.parse_args(argv)
    p = args.nproc
    print(f"{args.model}, {p} processes (gloo, CPU), micro-batches of {args.micro_size} x {args.block} tokens, "
          f"{args.steps} timed steps; MiB per process (the largest); bubble: mean over the stages")
    print("| layout | micro-batches | tokens/s | vs DDP | bubble | theory | params+grads+optim MiB | activations MiB "
          "| sent per step per process MiB |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    ddp = {}
    with tempfile.TemporaryDirectory() as tmp:
        from mingpt.model.gpt import PRESETS

        n_layer = next((int(o.split("=")[1]) for o in args.overrides if o.startswith("model.n_layer=")),
                       PRESETS[args.model][0])
        for name, settings, m in layouts(p, args.micro, n_layer):
            if not name.startswith(tuple(args.layouts.split(","))):
                continue
            pp = "pipeline" in " ".join(settings)
            stages = next((int(o.split("=")[1]) for o in settings if o.startswith("trainer.pipeline_parallel=")), 1)
            data_ranks = p // stages if pp else (1 if name.startswith("tp") else p)
            # one global batch for every row of a micro-batch count: m micro-batches of --micro-size (over
            # the pipelines where there are several: m / pipelines each)
            batch = m * args.micro_size
            micro_size = args.micro_size if pp else -(-batch // data_ranks)
            cfg = [f"model={args.model}", f"data.path={args.data}", f"data.cache_dir={tmp}/cache",
                   f"data.block_size={args.block}", f"trainer.batch_size={batch}", f"trainer.micro_batch_size={micro_size}",
                   "trainer.eval_every=0", "trainer.progress=false", "snapshot.every_steps=0", "snapshot.resume=never",
                   f"trainer.run_dir={tmp}/{name.replace(' ', '-')}-{m}", *settings, *args.overrides]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p}",
                   "-m", "benchmarks", "pipeline", "--worker", str(args.steps), str(args.warmup), *cfg]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            ranks = json.loads(lines[-1].removeprefix("RESULT "))
            rate = ranks[0]["tokens_per_s"]
            if name == "ddp":
                ddp[m] = rate
            state = max(r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks) / 2**20
            if pp:
                bubble = sum(1 - r["busy"] / r["scheduled"] for r in ranks) / len(ranks)
                v = 2 if "interleaved" in name else 1  # stages per process
                mp = m // data_ranks  # a pipeline's micro-batches
                if v > 1:  # rank 0's warm-up forwards (of one stage's micro-batch each) before its first backward
                    from torch.distributed.pipelining.schedules import _get_warmup_ops

                    in_flight = _get_warmup_ops(0, v, mp // max(1, mp // stages), stages, mp) + 1
                else:
                    in_flight = mp if "gpipe" in name else min(mp, stages)
                acts = max(r["saved_per_step"] / (mp * v) * in_flight for r in ranks) / 2**20
                # between the stages, and FSDP's collectives inside each (as the fsdp row: its shard x 3 (d-1))
                sent = max(r["sent_per_step"] + ("fsdp" in name) * 3 * (data_ranks - 1) * r["grad_bytes"]
                           for r in ranks) / 2**20
                theory = f"{(stages - 1) / (v * mp + stages - 1):.3f}"
                bub = f"{bubble:.3f}"
            else:
                bub, theory = "-", "-"
                acts = max(r["saved_per_step"] for r in ranks) / 2**20  # one micro-batch: a rank's whole share
                grads = max(r["grad_bytes"] for r in ranks)
                # ring all-reduce (DDP): 2 (n-1)/n of the gradients; FSDP: two all-gathers and a
                # reduce-scatter of the whole parameters, (n-1)/n each; TP: activations, not counted here
                sent = {"ddp": 2 * (p - 1) / p * grads, "fsdp": 3 * (p - 1) * grads}.get(name)
            vs = f"{rate / ddp[m]:.2f}" if ddp.get(m) else "-"
            sent_mib = "-" if sent is None else f"{sent / (1 if pp else 2**20):.3f}"
            print(f"| {name} | {m} | {rate:,.0f} | {vs} | {bub} | {theory} | {state:.2f} | {acts:.2f} | "
                  f"{sent_mib} |", flush=True)


if __name__ == "__main__":
    main()
