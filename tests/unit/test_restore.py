"""Loading a snapshot into live tensors (mingpt/snapshot/restore.py): messages that name a snapshot as its
user wrote the store, a transient read error, one bounded buffer, and the DDP restore across real
processes."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, save_state

from mingpt.snapshot import SnapshotError, SnapshotStore, Snapshotter
from mingpt.snapshot import snapshotter as snapshotter_module
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import read_whole, restore


def test_a_snapshot_on_s3_that_does_not_fit_or_is_damaged_is_named_by_its_url(s3):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("restore-msg")
    store = SnapshotStore("s3://restore-msg/run")
    path = save_state(store, 1, {"model": {"w": torch.arange(1000.0)}}, {})
    manifest = store.read_manifest(path)
    with pytest.raises(SnapshotError, match=r"^snapshot s3://restore-msg/run/step_000000001 does not fit this model"):
        restore(store, path, manifest, [Slot("model.w", torch.empty(4), (4,))], rank=0, world=1)
    fs.pipe_file(f"{path}/shard-00000-of-00001.bin", b"\0" * manifest["files"]["shard-00000-of-00001.bin"]["size"])
    with pytest.raises(SnapshotError, match=r"^snapshot s3://restore-msg/run/step_000000001 is damaged"):
        restore(store, path, manifest, [Slot("model.w", torch.empty(1000), (1000,))], rank=0, world=1)


def state(v: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(v))
    return {"model.w": torch.randn(37, 16, generator=g), "model.b": torch.randn(5, generator=g),
            "optim.w.exp_avg": torch.randn(37, 16, generator=g)}


def saved_store(tmp_path, steps=(1, 2)) -> SnapshotStore:
    store = SnapshotStore(str(tmp_path / "snapshots"))
    snap = Snapshotter(store, keep_last=5)
    for step in steps:
        snap.save(step, [Slot(k, t, tuple(t.shape)) for k, t in state(step).items()], {"trainer": {"step": step}},
                  {"world_size": 1})
        assert snap.wait() is True
    snap.close()
    return store


def empty_slots() -> list[Slot]:
    return [Slot(k, torch.full_like(t, -1.0), tuple(t.shape)) for k, t in state(0).items()]


def test_one_transient_read_error_does_not_pass_over_the_newest_snapshot(tmp_path, monkeypatch):
    store = saved_store(tmp_path)
    from mingpt.snapshot import transport
    from mingpt.snapshot.store import candidates, newest_that_loads

    real, failed = transport.pread_into, []

    def flaky(file, offset, out):
        if not failed:  # the first read of all fails, as a dropped connection would
            failed.append(file)
            raise ConnectionResetError(104, "Connection reset by peer")
        return real(file, offset, out)

    monkeypatch.setattr(transport, "pread_into", flaky)
    slots = empty_slots()
    found = candidates(store, [s for s in store.list() if s.committed])
    manifest, extra = newest_that_loads(store, found, lambda p, m: restore(store, p, m, slots, rank=0, world=1))
    assert failed and manifest["step"] == 2 and extra["trainer"] == {"step": 2}
    assert all(torch.equal(s.local, state(2)[s.name]) for s in slots)


def test_restore_reads_through_one_bounded_buffer(tmp_path, monkeypatch):
    """Chunks pass through one host buffer (pinned on a GPU) of the bound, or of the largest chunk
    when that is larger, a batch at a time: never the whole state at once."""
    from mingpt.snapshot import chunks as chunks_module

    store = saved_store(tmp_path, steps=(3,))
    path = store.list()[-1].path
    manifest = store.read_manifest(path)
    allocated = []
    real = chunks_module.host_buffer
    monkeypatch.setattr(chunks_module, "host_buffer", lambda n, pinned: allocated.append(n) or real(n, pinned))
    largest = max(f["size"] for name, f in manifest["files"].items() if name.startswith("shard"))  # one chunk each
    slots = empty_slots()
    restore(store, path, manifest, slots, rank=0, world=1, batch_bytes=100)
    assert allocated == [largest]  # one buffer: the bound is below the largest chunk
    assert all(torch.equal(s.local, state(3)[s.name]) for s in slots)
    slots = empty_slots()
    restore(store, path, manifest, slots, rank=0, world=1, batch_bytes=2**30)
    assert allocated[1] == largest  # never more than the bytes to read
    assert all(torch.equal(s.local, state(3)[s.name]) for s in slots)


# The DDP restore at several ranks, in real processes on gloo: each rank reads one share of the
# chunks and the shares travel in rounds of one all-gather of a bounded buffer. Small chunks and a
# small buffer here, so that shares cut chunks, pieces and rounds at every kind of boundary.
WRITERS, CHUNK, EXCHANGE = 3, 64, 120


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"model.a": torch.randn(37, 5, generator=g), "model.b": torch.randn(3, generator=g),
            "optim.a.exp_avg": torch.randn(37, 5, generator=g).to(torch.bfloat16), "optim.a.step": torch.tensor(9.0)}


def worker(rank: int, world: int, port: int, path: str, layout: str, sharded: bool, out: dict) -> None:
    from mingpt.parallel.shards import rows_of
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
    from test_store import write_sharded

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


def test_a_snapshot_with_attentions_fused_c_attn_is_refused_in_one_line(tmp_path):
    """Snapshots of the project's first week hold one c_attn (q, k and v rows one after the other):
    no longer read; refused in one line that names the tensor, when it changed and what to do."""
    store = SnapshotStore(str(tmp_path / "snapshots"))
    old = {"blocks.0.attn.c_attn.weight": torch.randn(3 * 8, 8), "wte.weight": torch.randn(5, 8)}
    snap = Snapshotter(store, keep_last=5)
    snap.save(3, [Slot(f"model.{k}", v, tuple(v.shape)) for k, v in old.items()], {"trainer": {"step": 3}},
              {"world_size": 1})
    assert snap.wait() is True
    snap.close()
    with pytest.raises(SnapshotError, match=r"holds attention's fused input projection \(model.blocks.0.attn.c_attn"
                                            r".weight\), saved before it was split into c_q, c_k, c_v \(2026-11-26\): "
                                            "continue it with the mingpt that wrote it"):
        read_whole(store, store.list()[-1].path)
