"""One process of `python -m benchmarks snapshot` (run under torchrun for 2 ranks, or plainly):

    save:   build the model as main.py does, one training step, then `repeats` saves of every rank
    resume: a new start that finds the newest snapshot, loads its share, and takes one step

It prints one JSON line from rank 0 with every rank's figures.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as tdist

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.parallel.layouts import parallelize
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo
from mingpt.runtime.exits import exit_process
from mingpt.snapshot import SnapshotStore, Snapshotter
from mingpt.snapshot.restore import restore
from mingpt.snapshot.store import candidates, newest_that_loads
from mingpt.training.optim import build_optimizer, init_state


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would also count the pages of the
    parent at fork)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def step(par, opt, vocab: int) -> None:
    x = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    with par.sync(last=True):
        _, loss = par.model(x, x)
        loss.backward()
    par.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    mode, shape, strategy, url, uploader, layout, repeats = sys.argv[1:8]
    info = DistInfo.from_env()
    distributed.init(info, 1800)
    t_start = time.perf_counter()
    cfg = GPTConfig(preset=shape, vocab_size=50257, block_size=64)
    with torch.device("meta"):
        raw = GPT(cfg)
    par = parallelize(raw, strategy, info, seed=0 if mode == "save" else None)
    opt = build_optimizer(raw, 1e-4, (0.9, 0.95), 0.1)
    init_state(opt)
    slots = par.slots(opt)
    held_mb = sum(s.local.numel() * s.local.element_size() for s in slots) / 2**20
    store = SnapshotStore(url, uploader=uploader)
    out = {"rank": info.rank, "held_mb": held_mb}
    if mode == "save":
        step(par, opt, cfg.vocab_size)
        out["fresh_rss_mb"] = peak_rss_mb()
        snap = Snapshotter(store, writer=info.rank, writers=info.world_size, group=distributed.side_group(),
                           keep_last=1, retries=2)
        totals = []
        for i in range(int(repeats)):
            distributed.barrier()
            t0 = time.perf_counter()
            snap.save(i + 1, par.slots(opt), {"trainer": {"step": i + 1}}, {"world_size": info.world_size,
                                                                           "parallel": par.name})
            snap.wait()  # the first writer returns once it has committed
            totals.append(time.perf_counter() - t0)
        snap.close()
        out.update(blocking_ms=1000 * sorted(snap.blocking_s)[len(totals) // 2], save_s=sorted(totals)[len(totals) // 2],
                   failures=snap.failures, peak_rss_mb=peak_rss_mb())
    else:
        t0 = time.perf_counter()
        found = distributed.on_rank0(lambda: candidates(store, [s for s in store.list() if s.committed]))

        def load(path, manifest):
            return restore(store, path, manifest, slots, rank=info.rank, world=info.world_size, layout=layout)

        newest_that_loads(store, found, load)
        t1 = time.perf_counter()
        step(par, opt, cfg.vocab_size)
        t2 = time.perf_counter()
        out.update(start_s=t0 - t_start, restore_s=t1 - t0, to_first_step_s=t2 - t0, peak_rss_mb=peak_rss_mb())
    everyone = [None] * info.world_size
    if tdist.is_initialized():
        tdist.all_gather_object(everyone, out)
    else:
        everyone = [out]
    if info.is_rank0:
        print(json.dumps(everyone), flush=True)
    distributed.shutdown()
    exit_process(0, had_process_group=info.distributed)


if __name__ == "__main__":
    main()
