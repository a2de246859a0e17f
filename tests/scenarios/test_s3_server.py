"""Snapshots on a real S3 server (SeaweedFS on loopback) that dies in the middle of a save."""

import logging
import time

import pytest
import torch

from benchmarks.seaweed import SeaweedFS
from mingpt.snapshot import SnapshotStore, Snapshotter
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import read_newest


@pytest.fixture
def own_server(tmp_path, monkeypatch):
    """A server of this test's own (the session's one must not die)."""
    import s3fs

    server = SeaweedFS(tmp_path / "weed")
    (tmp_path / "weed").mkdir()
    server.start()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    yield server
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def uploading(store: SnapshotStore) -> bool:
    """A multipart upload of the store is under way."""
    try:
        return bool(store.uploads())
    except Exception:  # noqa: BLE001 - the server is busy or gone
        return False


def test_the_server_killed_mid_save_and_restarted_loses_nothing_committed(own_server, caplog):
    import s3fs

    s3fs.S3FileSystem().mkdir("ckpt")
    store = SnapshotStore("s3://ckpt/run", {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})
    snap = Snapshotter(store, keep_last=5, retries=1, backoff_s=0.2)
    small = torch.arange(1000, dtype=torch.float32)
    snap.save(1, [Slot("model.w", small, (1000,))], {"trainer": {"step": 1}}, {})
    assert snap.wait() is True
    big = torch.randn(40_000_000)  # 160 MB: a multipart upload of 10 parts
    caplog.set_level(logging.WARNING)
    snap.save(2, [Slot("model.w", big, tuple(big.shape))], {"trainer": {"step": 2}}, {})
    deadline = time.monotonic() + 60
    while not uploading(store) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert uploading(store), "the upload never started"
    own_server.stop()  # SIGKILL, mid-upload
    assert snap.wait() is False  # reported, not raised: training would go on
    assert snap.failures == 1 and "snapshot step 2 failed" in caplog.text
    own_server.start()
    s3fs.S3FileSystem.clear_instance_cache()
    store = SnapshotStore("s3://ckpt/run")
    assert [s.step for s in store.list() if s.committed] == [1]
    state, manifest = read_newest(store)
    assert manifest["step"] == 1 and torch.equal(state["model"]["w"], small)
    # the job goes on: the next save commits, and the killed upload is found and aborted
    snap = Snapshotter(store, keep_last=5)
    snap.save(3, [Slot("model.w", big, tuple(big.shape))], {"trainer": {"step": 3}}, {})
    assert snap.wait() is True
    state, manifest = read_newest(store)
    assert manifest["step"] == 3 and torch.equal(state["model"]["w"], big)
    orphans = store.uploads()
    for upload in orphans:
        store.files.abort_upload(upload)
    assert store.uploads() == []
    snap.close()


def test_a_start_aborts_only_the_uploads_its_own_store_left_unfinished(s3, tmp_path):
    """A writer SIGKILLed mid-upload leaves a multipart upload with stored parts (billed until it is
    aborted); the next start of the job, before it saves anything, aborts it. With the store at the
    bucket's root, another upload in flight elsewhere in the bucket (a dataset, another run's store)
    is not the job's: it survives the start."""
    import subprocess
    import sys

    import s3fs
    from conftest import REPO, make_corpus, torchrun_env

    fs = s3fs.S3FileSystem()
    fs.mkdir("orphans")
    store = SnapshotStore("s3://orphans")

    def begin(key: str) -> None:
        upload = fs.call_s3("create_multipart_upload", Bucket="orphans", Key=key)
        fs.call_s3("upload_part", Bucket="orphans", Key=key, UploadId=upload["UploadId"], PartNumber=1,
                   Body=b"x" * 2**20)

    ours = "step_000000010/shard-00000-of-00002.bin"
    others = ["datasets/big.bin", "run2/step_000000010/shard-00000-of-00002.bin", "step_000000010.tmp/x.bin"]
    for key in [ours, *others]:
        begin(key)
    assert [u["key"] for u in store.uploads()] == [ours]
    corpus = make_corpus(tmp_path)
    proc = subprocess.run([sys.executable, "mingpt/main.py", "model=custom", "model.n_layer=1", "model.n_head=2",
                           "model.n_embd=32", "data.block_size=32", "trainer.max_steps=2", "trainer.progress=false",
                           f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                           f"trainer.run_dir={tmp_path / 'run'}", "snapshot.dir=s3://orphans"],
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "aborted 1 unfinished multipart upload left in s3://orphans" in proc.stderr
    in_flight = fs.call_s3("list_multipart_uploads", Bucket="orphans").get("Uploads", [])
    assert sorted(u["Key"] for u in in_flight) == sorted(others)
    assert [s.step for s in store.list() if s.committed] == [2]
