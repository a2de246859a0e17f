import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mingpt.config import RunConfig
from mingpt.main import MismatchError, check_compatible
from mingpt.model import GPTConfig
from mingpt.snapshot import SnapshotError, Snapshotter, SnapshotStore


def state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 4), v)}, "trainer": {"step": int(v)}}


def test_round_trip_and_manifest(store_url):
    store = SnapshotStore(store_url)
    path = store.save(10, state(10), {"config": {"a": 1}})
    loaded, manifest = store.load(path)
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 10.0))
    assert manifest["step"] == 10 and manifest["format_version"] == 1 and manifest["config"] == {"a": 1}
    assert manifest["files"]["state.pt"]["size"] == store.fs.size(f"{path}/state.pt")


def test_uncommitted_write_is_invisible(store_url):
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    store.fs.makedirs(f"{store.root}/step_000000002", exist_ok=True)
    store.fs.pipe(f"{store.root}/step_000000002/state.pt", b"half a write")  # no manifest: not committed
    assert [s.step for s in store.list()] == [1, 2]
    assert [s.step for s in store.list() if s.committed] == [1]
    assert store.load_latest()[1]["step"] == 1


def test_writer_killed_mid_write_leaves_previous_snapshot_valid(store_url):
    """A real SIGKILL of a process in the middle of writing a large snapshot (a multipart upload on S3)."""
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    code = textwrap.dedent(f"""
        import torch
        from mingpt.snapshot import SnapshotStore
        store = SnapshotStore({store_url!r}, {{"default_block_size": 5 * 2**20}} if {store_url!r}.startswith("s3") else None)
        big = {{"model": {{"w": torch.randn(64_000_000)}}}}
        print("writing", flush=True)
        store.save(2, big, {{}})
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.5)  # 256 MB take seconds to write: this is mid-write
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [s.step for s in store.list() if s.committed] == [1]
    assert store.load_latest()[1]["step"] == 1
    store.save(3, state(3), {})  # and the store goes on working
    assert store.load_latest()[1]["step"] == 3


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_latest_falls_back_with_warning(store_url, caplog, damage):
    store = SnapshotStore(store_url)
    store.save(1, state(1), {})
    p2 = store.save(2, state(2), {})
    f = f"{p2}/state.pt"
    data = store.fs.cat(f)
    store.fs.pipe(f, data[: len(data) // 2] if damage == "truncate" else data[:-8] + b"XXXXXXXX")
    loaded, manifest = store.load_latest()
    assert manifest["step"] == 1 and loaded["trainer"]["step"] == 1
    assert "falling back" in caplog.text


def test_all_snapshots_broken_is_an_error_not_a_fresh_start(tmp_path):
    store = SnapshotStore(str(tmp_path))
    p = store.save(1, state(1), {})
    open(f"{p}/state.pt", "wb").write(b"garbage")
    with pytest.raises(SnapshotError, match="snapshot.resume=never"):
        store.load_latest()


def test_format_version_is_checked(tmp_path):
    store = SnapshotStore(str(tmp_path))
    p = store.save(1, state(1), {})
    m = json.load(open(f"{p}/manifest.json"))
    m["format_version"] = 99
    json.dump(m, open(f"{p}/manifest.json", "w"))
    with pytest.raises(SnapshotError, match="format version 99"):
        store.load(p)


def test_retention_keeps_last_k_after_commit(store_url):
    store = SnapshotStore(store_url)
    for step in range(1, 8):
        store.save(step, state(step), {})
        store.prune(keep_last=2, keep_every=3)
    assert [s.step for s in store.list()] == [3, 6, 7]
    store.prune(keep_last=2)
    assert [s.step for s in store.list()] == [6, 7]


def test_only_the_first_rank_writes(tmp_path):
    """for rank in range(2), no process group: the Trainer's save is a no-op except on rank 0."""
    from mingpt.distributed import DistInfo
    from mingpt.trainer import Trainer

    written = []
    for rank in range(2):
        info = DistInfo(rank=rank, world_size=2)
        store = SnapshotStore(str(tmp_path / f"as_rank{rank}"))
        fake = Trainer.__new__(Trainer)  # only the parts save_snapshot uses
        fake.dist, fake.snapshotter = info, Snapshotter(store, keep_last=3, enabled=info.is_first)
        fake.state_dict = lambda: state(1)
        fake.step, fake.tokens_seen, fake.run_meta = 1, 0, {}
        fake.save_snapshot()
        fake.snapshotter.close()
        written.append(bool(store.list()))
    assert written == [True, False]


def test_snapshot_of_another_model_shape_is_refused():
    cfg = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65))
    manifest = {"config": cfg.to_dict(), "model_shape": GPTConfig(preset="gpt-mini", vocab_size=65).shape_dict()}
    with pytest.raises(MismatchError, match=r"n_layer: snapshot 6 vs config 4.*n_embd: snapshot 192 vs config 128"):
        check_compatible(cfg, manifest)
    manifest["model_shape"] = cfg.model.shape_dict()
    check_compatible(cfg, manifest)  # same shape: accepted
