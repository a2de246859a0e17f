"""The DDP restore at several ranks, in real processes on gloo: each rank reads one share of the
chunks and the shares travel in rounds of one all-gather of a bounded buffer. Small chunks and a
small buffer here, so that shares cut chunks, pieces and rounds at every kind of boundary."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot import snapshotter as snapshotter_module

WRITERS, CHUNK, EXCHANGE = 3, 64, 120


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"model.a": torch.randn(37, 5, generator=g), "model.b": torch.randn(3, generator=g),
            "optim.a.exp_avg": torch.randn(37, 5, generator=g).to(torch.bfloat16), "optim.a.step": torch.tensor(9.0)}


def worker(rank: int, world: int, port: int, path: str, layout: str, sharded: bool, out: dict) -> None:
    from mingpt.model import rows_of
    from mingpt.snapshot.layout import Slot, n_rows
    from mingpt.snapshot.restore import restore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls = {"all_gather": 0, "all_reduce": 0}
    for name in calls:
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1) or
                _real(*a, **k))
    store = SnapshotStore(os.path.dirname(path))
    slots = []
    for name, full in tensors().items():
        if sharded and full.dim():  # FSDP's rows for matrices and vectors; scalars stay replicated
            start, stop = rows_of(n_rows(full.shape), world, rank)
            slots.append(Slot(name, torch.full_like(full[start:stop], -1), tuple(full.shape), start, sharded=True))
        else:
            slots.append(Slot(name, torch.full_like(full, -1), tuple(full.shape)))
    restore(store, path, store.read_manifest(path), slots, rank=rank, world=world, layout=layout,
            exchange_bytes=EXCHANGE)
    want = tensors()
    out[rank] = {"equal": all(torch.equal(s.local, want[s.name][s.start:s.stop] if s.sharded else want[s.name])
                              for s in slots), **calls}
    dist.destroy_process_group()


@pytest.mark.parametrize("world,layout,sharded", [(2, "exchange", False), (4, "exchange", False),
                                                   (3, "direct", False), (3, "exchange", True)])
def test_every_rank_ends_with_the_snapshot_bitwise_in_few_collectives(tmp_path, monkeypatch, world, layout, sharded):
    from test_snapshot import write_sharded

    monkeypatch.setattr(snapshotter_module, "CHUNK_BYTES", CHUNK)
    path = write_sharded(SnapshotStore(str(tmp_path)), 7, tensors(), WRITERS)
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(worker, args=(world, free_port(), path, layout, sharded, out), nprocs=world, join=True)
    assert sorted(out) == list(range(world)) and all(r["equal"] for r in out.values()), dict(out)
    replicated = sum(t.numel() * t.element_size() for t in tensors().values() if not sharded or t.dim() == 0)
    rounds = -(-(replicated // world + CHUNK) // (EXCHANGE // world)) if layout == "exchange" else 0
    for r in out.values():
        assert r["all_reduce"] == 1  # the ranks agree once that every chunk checked out
        assert 0 < r["all_gather"] <= rounds if layout == "exchange" else r["all_gather"] == 0, (r, rounds)
