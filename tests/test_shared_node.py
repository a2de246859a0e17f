"""Smaller safety fixes for shared clusters: what listens, what a kill leaves behind, what a
transient error or a large state costs."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, read_metrics

from mingpt.snapshot import SnapshotStore, Snapshotter
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import restore, restore_newest


def listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc shows them) listening on TCP `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_the_rendezvous_store_listens_on_the_chosen_address_only():
    """torchrun's rendezvous unpickles what it reads from the store: it must not listen on every
    interface (TCPStore itself binds all of them, whatever host it is given)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mingpt.cli.rendezvous", "--host", "127.0.0.1", "--port",
                               str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 30
        while not listeners(port):
            assert time.time() < deadline and server.poll() is None, server.communicate()[0]
            time.sleep(0.1)
        assert listeners(port) == ["0100007F"]  # 127.0.0.1, and nothing else
        from datetime import timedelta

        client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        server.terminate()
        server.wait(timeout=30)
    missing = subprocess.run([sys.executable, "-m", "mingpt.cli.rendezvous", "--port", str(port)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--host" in missing.stderr


def test_read_metrics_skips_a_line_cut_short_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows[:2]) + "\n" + rows[2][:17] + "\n" + json.dumps({"kind": "train", "step": 3,
                                                                                      "loss": 0.3}) + "\n")
    assert {s: r["loss"] for s, r in read_metrics(path).items()} == {1: 1.0, 2: 0.5, 3: 0.3}


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
    from mingpt.snapshot.start import candidates

    real, failed = transport.pread_into, []

    def flaky(file, offset, out):
        if not failed:  # the first read of all fails, as a dropped connection would
            failed.append(file)
            raise ConnectionResetError(104, "Connection reset by peer")
        return real(file, offset, out)

    monkeypatch.setattr(transport, "pread_into", flaky)
    slots = empty_slots()
    found = candidates(store, [s for s in store.list() if s.committed])
    manifest, extra = restore_newest(store, found, lambda p, m: restore(store, p, m, slots, rank=0, world=1),
                                     lambda m: None)
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


def test_mingpt_snapshot_lists_and_aborts_uploads_that_dead_processes_left(s3, capsys):
    """A process killed during an upload leaves an unfinished multipart upload (its parts are billed
    until aborted): the tool lists them, and aborts them with --abort."""
    import s3fs

    from mingpt.cli.snapshot import main

    fs = s3fs.S3FileSystem()
    fs.mkdir("mpu-dead")
    mpu = fs.call_s3("create_multipart_upload", Bucket="mpu-dead", Key="run/step_000000010/shard-00000-of-00002.bin")
    fs.call_s3("upload_part", Bucket="mpu-dead", Key="run/step_000000010/shard-00000-of-00002.bin",
               UploadId=mpu["UploadId"], PartNumber=1, Body=b"x" * 1024)
    assert main(["uploads", "s3://mpu-dead/run", "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert "unfinished: s3://mpu-dead/run/step_000000010/shard-00000-of-00002.bin" in out
    assert "1 unfinished multipart upload older than 0 h" in out and "--abort" in out
    assert main(["uploads", "s3://mpu-dead/run", "--older-than", "0", "--abort"]) == 0
    assert "aborted: s3://mpu-dead/run/step_000000010" in capsys.readouterr().out
    assert SnapshotStore("s3://mpu-dead/run").uploads() == []
