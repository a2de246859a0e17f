"""One replica group of the survivors bench's torchft row (benchmarks/survivors.py), run under its own
torchrun of one process: the same model, optimizer, schedule and global batch as the mingpt job,
trained through torchft 0.2.0's `Manager` (a quorum from its lighthouse every step, the gradients
averaged with `Manager.allreduce`, the optimizer stepped only if `should_commit`; a restarted group
heals from a live one through torchft's own checkpoint transport). torchft is a benchmark-only extra,
never a dependency of the package. Run it on a machine of your own: torchft's checkpoint server listens
on every interface and unpickles what it receives.

Each group trains its third of the global batch, drawn from the step and the group's number (torchft
keeps each replica's batch: the global batch shrinks while a group is away, its issue #186). Each
group appends its records (mingpt's `start` and `train` kinds) to metrics-<group>.jsonl; the first
group that ends writes its final weights to final-<group>.pt (a group still waiting for a quorum
then is stopped by the bench: torchft has no end of a job that a late group can learn).

    python -m torch.distributed.run --standalone --nproc_per_node=1 -m benchmarks.torchft_worker \
        --group G --groups 3 --lighthouse http://127.0.0.1:PORT --run-dir DIR [--model gpt-mini] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
from torchft import Manager, ProcessGroupGloo

from mingpt.config.compose import compose
from mingpt.model.gpt import GPT
from mingpt.model.tokenizer import CharTokenizer
from mingpt.training.ledger import process_start_epoch
from mingpt.training.optim import build_optimizer, init_state, lr_at


def main() -> None:
    t0 = process_start_epoch()  # as mingpt's start record: the process's start, its imports included
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--corpus", default="data/input.txt")
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose([f"model={args.model}"])
    text = Path(args.corpus).read_text()
    tokenizer = CharTokenizer("".join(sorted(set(text))))  # the char tokenizer of a stream run
    tokens = torch.from_numpy(tokenizer.encode_ids(text))
    block, batch = cfg.data.block_size, cfg.trainer.batch_size // args.groups
    torch.manual_seed(cfg.trainer.seed)
    gpt = GPT(replace(cfg.model, vocab_size=tokenizer.vocab_size, block_size=block))
    gpt.init_weights(cfg.trainer.seed)
    o = cfg.optim
    optimizer = build_optimizer(gpt, o.lr, o.betas, o.weight_decay)
    init_state(optimizer)

    def load_state_dict(sd: dict) -> None:
        gpt.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=2,
                      load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": gpt.state_dict(), "optim": optimizer.state_dict()},
                      replica_id=f"group{args.group}", lighthouse_addr=args.lighthouse, rank=0, world_size=1,
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=60))
    out = open(Path(args.run_dir) / f"metrics-{args.group}.jsonl", "a")

    def record(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()

    record({"kind": "start", "group": args.group, "t0": t0})
    params = list(gpt.parameters())
    while manager.current_step() < args.steps:
        began = time.perf_counter()
        manager.start_quorum()
        step = manager.current_step()
        g = torch.Generator().manual_seed(step * 1000 + args.group)
        at = torch.randint(0, len(tokens) - block - 1, (batch,), generator=g)
        x = torch.stack([tokens[i:i + block] for i in at])
        y = torch.stack([tokens[i + 1:i + 1 + block] for i in at])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, o.lr, o.min_lr, o.warmup_steps, args.steps)
        optimizer.zero_grad(set_to_none=False)
        _, loss = gpt(x, y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()  # the average over the quorum's replicas
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        if manager.should_commit():
            optimizer.step()
            record({"kind": "train", "step": manager.current_step(), "time": time.time(), "group": args.group,
                    "participants": manager.num_participants(), "loss": loss.item(),
                    "step_ms": (time.perf_counter() - began) * 1000})
    final = Path(args.run_dir) / f"final-{args.group}.pt"
    torch.save(gpt.state_dict(), final.with_suffix(".tmp"))
    final.with_suffix(".tmp").rename(final)  # the bench's sign that the job is done
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
