import logging
import subprocess
import sys

import pytest
import torch
from conftest import fs_of, save_state

from mingpt.cli.snapshot import main as snapshot_cli
from mingpt.cli.snapshot import weights_digest
from mingpt.snapshot import SnapshotError, SnapshotStore, Snapshotter, open_store
from mingpt.snapshot.layout import Slot


def test_async_save_copies_state_before_training_goes_on(store_url):
    store = SnapshotStore(store_url)
    snap = Snapshotter(store, keep_last=2)
    w = torch.zeros(1000)
    snap.save(1, [Slot("model.w", w, (1000,))], {}, {})
    w.add_(1.0)  # training continues and changes the live tensor
    snap.close()
    loaded, _ = store.load_latest()
    assert torch.equal(loaded["model"]["w"], torch.zeros(1000))
    assert snap.last_saved_step == 1 and len(snap.blocking_s) == 1


def test_multipart_sized_snapshot_on_s3(s3):
    import s3fs

    s3fs.S3FileSystem().mkdir("multipart")
    big = {"model": {"w": torch.randn(20_000_000)}}  # 80 MB: five parts of up to 16 MiB, in flight together
    for uploader in ("s3fs", "boto3"):
        store = SnapshotStore(f"s3://multipart/{uploader}", uploader=uploader)
        path = save_state(store, 3, big, {})
        loaded, manifest = store.load(path)
        assert manifest["files"]["shard-00000-of-00001.bin"]["size"] == 80_000_000
        assert torch.equal(loaded["model"]["w"], big["model"]["w"])
        key = path.split("/", 1)[1] + "/shard-00000-of-00001.bin"
        etag = fs_of(store).call_s3("head_object", Bucket="multipart", Key=key)["ETag"]
        assert etag.strip('"').endswith("-5"), etag  # S3 marks a multipart object's ETag with its part count


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
        assert snap.failures == 1 and snap.last_saved_step == 1
        assert "snapshot step 2 failed after 2 attempts" in caplog.text
        assert "retrying" in caplog.text
    finally:
        # the same port again; moto's state lives in this process, so the bucket is still there
        s3_server["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_server["port"], verbose=False)
        s3_server["server"].start()
    fs_of(store).invalidate_cache()
    assert [s.step for s in store.list() if s.committed] == [1]
    assert store.load_latest()[1]["step"] == 1
    snap.close()


def test_unreachable_bucket_is_one_clear_error_without_credentials(s3):
    message = "bucket no-such-bucket of s3://no-such-bucket/x does not exist or is not reachable"
    with pytest.raises(SnapshotError, match=message) as e:
        open_store("s3://no-such-bucket/x", None)
    assert "test-secret-do-not-log" not in str(e.value)
    with pytest.raises(SnapshotError, match="snapshot.endpoint_url"):
        open_store("s3://bucket/x", "http://127.0.0.1:9")  # nothing listens on the discard port


def test_a_snapshot_dir_that_is_a_file_says_so_without_cloud_hints(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(SnapshotError, match=r"cannot use snapshot store .*not-a-dir .*point snapshot.dir") as e:
        open_store(str(f), None)
    assert "AWS" not in str(e.value) and "endpoint" not in str(e.value)


def test_snapshot_cli_list_show_verify(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path))
    save_state(store, 1, {"model": {"w": torch.ones(3)}}, {"world_size": 2})
    p2 = save_state(store, 2, {"model": {"w": torch.zeros(3)}}, {"world_size": 2})
    (tmp_path / "step_000000003").mkdir()
    assert snapshot_cli(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "incomplete" in out
    assert snapshot_cli(["verify", str(tmp_path)]) == 0
    assert weights_digest({"w": torch.zeros(3)}) in capsys.readouterr().out
    assert snapshot_cli(["show", str(tmp_path), "--step", "1", "--json"]) == 0
    assert '"step": 1' in capsys.readouterr().out
    listed = subprocess.run([sys.executable, "-m", "mingpt.cli.snapshot", "list", str(tmp_path)], capture_output=True,
                            text=True, check=True).stdout  # the installed tool is the same module
    assert "committed" in listed and "incomplete" in listed
    with open(f"{p2}/shard-00000-of-00001.bin", "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"oops")
    assert snapshot_cli(["verify", str(tmp_path), "--json"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "shard-00000-of-00001.bin fails its checksum" in out
