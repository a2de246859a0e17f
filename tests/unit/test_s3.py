"""The S3 transport (mingpt/snapshot/s3.py) on a real S3 server: multipart uploads, and an upload
aborted only once every part has ended."""

import asyncio

import pytest
import torch
from conftest import fs_of, save_state

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_whole


def test_multipart_sized_snapshot_on_s3(s3):
    import s3fs

    s3fs.S3FileSystem().mkdir("multipart")
    big = {"model": {"w": torch.randn(20_000_000)}}  # 80 MB: five parts of up to 16 MiB, in flight together
    for uploader in ("s3fs", "boto3"):
        store = SnapshotStore(f"s3://multipart/{uploader}", uploader=uploader)
        path = save_state(store, 3, big, {})
        loaded, manifest = read_whole(store, path)
        assert manifest["files"]["shard-00000-of-00001.bin"]["size"] == 80_000_000
        assert torch.equal(loaded["model"]["w"], big["model"]["w"])
        key = path.split("/", 1)[1] + "/shard-00000-of-00001.bin"
        etag = fs_of(store).call_s3("head_object", Bucket="multipart", Key=key)["ETag"]
        assert etag.strip('"').endswith("-5"), etag  # S3 marks a multipart object's ETag with its part count


def test_a_failed_part_aborts_the_upload_only_after_every_part_has_ended(s3, monkeypatch):
    """An abort while other parts are still uploading can leave those parts stored (and billed):
    the upload is aborted once every part has ended, and the store holds no unfinished upload."""
    import s3fs

    from mingpt.snapshot import s3 as s3_module

    s3fs.S3FileSystem().mkdir("mpu-abort")
    store = SnapshotStore("s3://mpu-abort/run")
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 * 2**20)  # S3's smallest part
    events = []
    real = store.files.fs._call_s3

    async def call(method, *args, **kwargs):
        if method == "upload_part":
            n = kwargs["PartNumber"]
            if n == 1:
                events.append("part 1 failed")
                raise ConnectionResetError(104, "Connection reset by peer")
            await asyncio.sleep(0.3)  # the others are still in flight when part 1 fails
            out = await real(method, *args, **kwargs)
            events.append(f"part {n} ended")
            return out
        if method == "abort_multipart_upload":
            events.append("abort")
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(store.files.fs, "_call_s3", call)
    with pytest.raises(ConnectionResetError):
        store.files.put("mpu-abort/run/big.bin", bytes(16 * 2**20))
    assert events[0] == "part 1 failed" and events[-1] == "abort" and events.count("abort") == 1
    assert sorted(events[1:-1]) == ["part 2 ended", "part 3 ended", "part 4 ended"]
    monkeypatch.undo()
    assert SnapshotStore("s3://mpu-abort/run").uploads() == []
