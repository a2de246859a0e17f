"""The snapshotter's outcomes: what it logs and reports when a save, or the retention after it, fails."""

import errno
import logging

import torch
from conftest import fs_of, save_state

from mingpt.snapshot import SnapshotStore, Snapshotter
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import read_newest


def save(snap: Snapshotter, step: int) -> bool:
    snap.save(step, [Slot("model.w", torch.full((4, 4), float(step)), (4, 4))], {"trainer": {"step": step}}, {})
    return snap.wait()


def test_a_failed_prune_does_not_fail_the_committed_save(tmp_path, monkeypatch, caplog):
    """Step 2 is committed: an error deleting older snapshots is one warning, not a failed save
    (which would make a final save exit 74 saying step 2 could not be saved)."""
    store = SnapshotStore(str(tmp_path))
    snap = Snapshotter(store, keep_last=1, retries=0)
    assert save(snap, 1) is True

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "step_000000001"))

    monkeypatch.setattr(store, "prune", refused)
    assert save(snap, 2) is True
    snap.close()
    assert snap.failures == 0 and [s.step for s in store.list() if s.committed] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [(f"snapshot step 2 committed, but pruning older snapshots failed (PermissionError: [Errno 13] "
                         f"Permission denied: '{tmp_path / 'step_000000001'}'); the next save prunes again")]
    assert read_newest(store)[1]["step"] == 2


def test_a_save_to_a_full_disk_is_reported_once_and_never_says_training_goes_on(tmp_path, monkeypatch, caplog):
    """The snapshotter cannot know whether training goes on (a final or preemption save ends the
    run with exit 74): it says what failed and which snapshot is still the newest, once; the retries
    are one warning, not one per attempt."""
    store = SnapshotStore(str(tmp_path))
    snap = Snapshotter(store, retries=3, backoff_s=0.01)
    assert save(snap, 1) is True

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_file", full)
    assert save(snap, 2) is False
    snap.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "training goes on" not in caplog.text
    assert errors == [("snapshot step 2 failed after 4 attempts writing its shard (OSError: [Errno 28] No space left "
                       "on device)"),
                      ("snapshot step 2 not committed: shard-00000-of-00001.bin could not be written; the newest "
                       "snapshot is still step 1")]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "snapshot step 2: writing its shard failed (OSError: [Errno 28] No space left on device); retrying up to 3 times"]


def test_async_save_copies_state_before_training_goes_on(store_url):
    store = SnapshotStore(store_url)
    snap = Snapshotter(store, keep_last=2)
    w = torch.zeros(1000)
    snap.save(1, [Slot("model.w", w, (1000,))], {}, {})
    w.add_(1.0)  # training continues and changes the live tensor
    snap.close()
    loaded, _ = read_newest(store)
    assert torch.equal(loaded["model"]["w"], torch.zeros(1000))
    assert [s.step for s in store.list() if s.committed] == [1] and len(snap.blocking_s) == 1


def test_endpoint_going_away_mid_run_is_reported_and_training_goes_on(s3_server, caplog):
    import s3fs
    from moto.server import ThreadedMotoServer

    s3fs.S3FileSystem().mkdir("flaky")
    store = SnapshotStore("s3://flaky/run", {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})
    snap = Snapshotter(store, keep_last=3, retries=1, backoff_s=0.1)
    snap.save(1, [Slot("model.w", torch.ones(10), (10,))], {}, {})
    snap.wait()
    server = s3_server["server"]
    server.stop()
    try:
        caplog.set_level(logging.WARNING)
        snap.save(2, [Slot("model.w", torch.full((10,), 2.0), (10,))], {}, {})
        snap.wait()  # does not raise: the failure is reported
        assert snap.failures == 1 and snap.last_ok is False
        assert "snapshot step 2 failed after 2 attempts" in caplog.text
        assert "retrying" in caplog.text
    finally:
        # the same port again; moto's state lives in this process, so the bucket is still there
        s3_server["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_server["port"], verbose=False)
        s3_server["server"].start()
    fs_of(store).invalidate_cache()
    assert [s.step for s in store.list() if s.committed] == [1]
    assert read_newest(store)[1]["step"] == 1
    snap.close()


def test_retention_never_deletes_the_newest_snapshot_of_this_run(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"))
    for step in (100, 200):  # higher steps that are not this run's (e.g. a broken newer lineage)
        save_state(store, step, {"model": {"w": torch.zeros(1)}}, {})
    snap = Snapshotter(store, keep_last=1)
    snap.save(5, [Slot("model.w", torch.ones(1), (1,))], {}, {})
    snap.close()
    assert 5 in [s.step for s in store.list() if s.committed]
