"""The node cache: each writer's copy of the newest snapshots in node-local memory, trusted only
through the manifest's checksums."""

import logging

import pytest
import torch

from mingpt.snapshot import SnapshotError, Snapshotter, SnapshotStore
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.nodecache import NodeCache
from mingpt.snapshot.restore import restore

SHARD = "shard-00000-of-00001.bin"


def tensors(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v))
    return {"model.w": torch.randn(33, 8, generator=g), "optim.w.exp_avg": torch.randn(33, 8, generator=g) + v}


def save(store, cache, step):
    snap = Snapshotter(store, keep_last=5, cache=cache)
    slots = [Slot(k, t, tuple(t.shape)) for k, t in tensors(step).items()]
    snap.save(step, slots, {"trainer": {"step": step}}, {"world_size": 1})
    snap.close()
    return store.read_manifest(store.list()[-1].path), store.list()[-1].path


def load(store, path, manifest, cache):
    slots = [Slot(k, torch.full_like(t, -1.0), tuple(t.shape)) for k, t in tensors(0).items()]
    extra = restore(store, path, manifest, slots, rank=0, world=1, cache=cache)
    return extra, {s.name: s.local for s in slots}


def flip_byte(fs_write, data: bytes, at: int = 7):
    damaged = bytearray(data)
    damaged[at] ^= 0xFF
    fs_write(bytes(damaged))


def test_a_restart_reads_the_node_copy_and_falls_back_to_the_store_piece_by_piece(store_url, tmp_path, caplog):
    store = SnapshotStore(store_url)
    cache = NodeCache(str(tmp_path / "shm"), store.url)
    for step in (1, 2, 3):
        manifest, path = save(store, cache, step)
    assert sorted(p.name for p in cache.dir.iterdir()) == ["step_000000002", "step_000000003"]  # the 2 newest
    copy = cache.folder(3) / SHARD
    assert copy.read_bytes() == store.fs.cat_file(f"{path}/{SHARD}")
    # the store's shard damaged, the node's copy intact: loaded from the copy, bitwise
    good = store.fs.cat_file(f"{path}/{SHARD}")
    flip_byte(lambda b: store.fs.pipe_file(f"{path}/{SHARD}", b), good)
    with caplog.at_level(logging.INFO, logger="mingpt.snapshot.store"):
        extra, got = load(store, path, manifest, cache)
    assert extra["trainer"] == {"step": 3} and all(torch.equal(got[k], v) for k, v in tensors(3).items())
    assert "node cache: 2 of 2 pieces read from" in caplog.text
    # the copy damaged, the store intact: the store answers
    store.fs.pipe_file(f"{path}/{SHARD}", good)
    flip_byte(copy.write_bytes, good)
    extra, got = load(store, path, manifest, cache)
    assert all(torch.equal(got[k], v) for k, v in tensors(3).items())
    # both damaged: the snapshot is damaged, and its shard is named
    flip_byte(lambda b: store.fs.pipe_file(f"{path}/{SHARD}", b), good)
    with pytest.raises(SnapshotError, match=f"{SHARD} fails its checksum"):
        load(store, path, manifest, cache)


def test_a_node_without_room_turns_the_cache_off_and_saves_go_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")  # the cache cannot create its folder under a file: like a full /dev/shm
    store = SnapshotStore(str(tmp_path / "snapshots"))
    cache = NodeCache(str(blocker), store.url)
    with caplog.at_level(logging.WARNING):
        manifest, path = save(store, cache, 4)
    assert not cache.enabled and "node cache off: cannot keep" in caplog.text
    assert store.list()[-1].committed and store.verify(path) == []
    _, got = load(store, path, manifest, cache)
    assert all(torch.equal(got[k], v) for k, v in tensors(4).items())
