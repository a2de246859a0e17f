"""One rank of `python -m benchmarks scale`, under torchrun: a save (every rank writes its share,
writer 0 commits) and a DDP restore of a model's full training state, counting every collective.

    python -m benchmarks.scale_worker SHAPE STORE

Prints one JSON line from rank 0 with every rank's figures.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.parallel.layouts import parallelize
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo
from mingpt.snapshot import SnapshotStore, Snapshotter
from mingpt.snapshot.restore import restore
from mingpt.training.optim import build_optimizer, init_state

# gpt2's count of tensors (12 blocks) at widths that fit many processes on one machine
SHAPES = {"gpt-nano": GPTConfig(preset="gpt-nano", vocab_size=65, block_size=64),
          "gpt2-tensors": GPTConfig(preset=None, n_layer=12, n_head=2, n_embd=32, vocab_size=256, block_size=64)}
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "gather", "all_gather_object", "broadcast_object_list")


class Counter:
    """Calls and payload bytes of every collective this process starts (all groups)."""

    def __init__(self):
        self.calls, self.bytes = 0, 0
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, real):
        def counted(*args, **kwargs):
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in args[:2] if isinstance(t, torch.Tensor))
            self.bytes += sum(t.numel() * t.element_size() for a in args[:2] if isinstance(a, list) for t in a
                              if isinstance(t, torch.Tensor))
            return real(*args, **kwargs)
        return counted

    def reset(self) -> tuple[int, int]:
        out = (self.calls, self.bytes)
        self.calls = self.bytes = 0
        return out


def main() -> None:
    shape, url = sys.argv[1], sys.argv[2]
    info = DistInfo.from_env()
    distributed.init(info, 600, threads=1)
    with torch.device("meta"):
        gpt = GPT(SHAPES[shape])
    par = parallelize(gpt, "ddp", info, seed=0)
    opt = build_optimizer(par.gpt, 1e-3, (0.9, 0.95), 0.1)
    init_state(opt)
    slots = par.slots(opt)
    snap = Snapshotter(SnapshotStore(url), writer=info.rank, writers=info.world_size, group=distributed.side_group(),
                       keep_last=10)
    count = Counter()
    distributed.barrier()
    count.reset()
    t0 = time.perf_counter()
    snap.save(1, slots, {"trainer": {"step": 1}}, {"world_size": info.world_size})
    ok = snap.wait()
    save_s = time.perf_counter() - t0
    save_calls, save_bytes = count.reset()
    distributed.barrier()
    count.reset()
    store = SnapshotStore(url)
    path = store.list()[-1].path
    manifest_bytes = os.path.getsize(f"{path}/manifest.json")
    manifest = store.read_manifest(path)
    for s in slots:
        s.local.zero_()
    t0 = time.perf_counter()
    restore(store, path, manifest, slots, rank=info.rank, world=info.world_size)
    restore_s = time.perf_counter() - t0
    restore_calls, restore_bytes = count.reset()
    mine = {"ok": bool(ok), "save_s": save_s, "save_collectives": save_calls, "save_bytes": save_bytes,
            "restore_s": restore_s, "restore_collectives": restore_calls, "restore_bytes": restore_bytes,
            "manifest_bytes": manifest_bytes, "tensors": len(slots),
            "state_bytes": sum(s.local.numel() * s.local.element_size() for s in slots)}
    everyone = distributed.all_gather_objects(mine)
    if info.is_rank0:
        print(json.dumps(everyone))
    snap.close()
    distributed.shutdown()


if __name__ == "__main__":
    main()
