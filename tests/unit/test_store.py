import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import fs_of, save_state

from mingpt.snapshot import SnapshotError, SnapshotStore, open_store
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.restore import read_newest, read_whole

SHARD = "shard-00000-of-00001.bin"


def state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 4), v)}, "trainer": {"step": int(v)}}


def test_round_trip_and_manifest(store_url):
    store = SnapshotStore(store_url)
    path = save_state(store, 10, state(10), {"config": {"a": 1}})
    loaded, manifest = read_whole(store, path)
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 10.0)) and loaded["trainer"] == {"step": 10}
    assert manifest["step"] == 10 and manifest["format_version"] == 3 and manifest["config"] == {"a": 1}
    assert set(manifest["files"]) == {SHARD, "extra.pt"}
    for name, f in manifest["files"].items():
        assert f["size"] == fs_of(store).size(f"{path}/{name}")


def test_uncommitted_write_is_invisible(store_url):
    store = SnapshotStore(store_url)
    save_state(store, 1, state(1), {})
    fs_of(store).makedirs(f"{store.root}/step_000000002", exist_ok=True)
    fs_of(store).pipe(f"{store.root}/step_000000002/state.pt", b"half a write")  # no manifest: not committed
    assert [s.step for s in store.list()] == [1, 2]
    assert [s.step for s in store.list() if s.committed] == [1]
    assert read_newest(store)[1]["step"] == 1


def test_writer_killed_mid_write_leaves_previous_snapshot_valid(store_url):
    """A real SIGKILL of a process in the middle of writing a large snapshot (a multipart upload on S3)."""
    store = SnapshotStore(store_url)
    save_state(store, 1, state(1), {})
    code = textwrap.dedent(f"""
        import torch
        from mingpt.snapshot import Snapshotter, SnapshotStore
        from mingpt.snapshot.layout import Slot
        store = SnapshotStore({store_url!r}, {{"default_block_size": 5 * 2**20}} if {store_url!r}.startswith("s3") else None)
        w = torch.randn(64_000_000)
        print("writing", flush=True)
        snap = Snapshotter(store, retries=0)
        snap.save(2, [Slot("model.w", w, tuple(w.shape))], {{}}, {{}})
        snap.wait()
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    deadline = time.time() + 60
    while time.time() < deadline and not mid_write(store):  # the shard is being written: kill now
        time.sleep(0.001)
    assert proc.poll() is None, "the write ended before the kill"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [s.step for s in store.list() if s.committed] == [1]
    assert read_newest(store)[1]["step"] == 1
    save_state(store, 3, state(3), {})  # and the store goes on working
    assert read_newest(store)[1]["step"] == 3


def mid_write(store: SnapshotStore) -> bool:
    """A shard of step 2 is half written: a local temporary file, or an S3 multipart upload begun."""
    if store.local:
        folder = f"{store.root}/step_000000002"
        return fs_of(store).exists(folder) and any(".shard-" in p for p in fs_of(store).ls(folder, detail=False))
    bucket = store.root.split("/", 1)[0]
    return bool(fs_of(store).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_latest_falls_back_with_warning(store_url, caplog, damage):
    store = SnapshotStore(store_url)
    save_state(store, 1, state(1), {})
    p2 = save_state(store, 2, state(2), {})
    f = f"{p2}/{SHARD}"
    data = fs_of(store).cat(f)
    fs_of(store).pipe(f, data[: len(data) // 2] if damage == "truncate" else data[:-8] + b"XXXXXXXX")
    loaded, manifest = read_newest(store)
    assert manifest["step"] == 1 and loaded["trainer"]["step"] == 1
    assert "falling back" in caplog.text


def test_all_snapshots_broken_is_an_error_not_a_fresh_start(tmp_path):
    store = SnapshotStore(str(tmp_path))
    p = save_state(store, 1, state(1), {})
    open(f"{p}/{SHARD}", "wb").write(b"garbage")
    with pytest.raises(SnapshotError, match="snapshot.resume=never"):
        read_newest(store)


@pytest.mark.parametrize("version", [1, 2, 99])
def test_format_version_is_checked(tmp_path, version):
    """Another format (1: the single state.pt of this project's first week; 2: a checksum per piece,
    before 2026-11-24; both no longer read) is refused in one line that says which mingpt to use."""
    store = SnapshotStore(str(tmp_path))
    p = save_state(store, 1, state(1), {})
    m = json.load(open(f"{p}/manifest.json"))
    m["format_version"] = version
    json.dump(m, open(f"{p}/manifest.json", "w"))
    with pytest.raises(SnapshotError, match=f"format version {version}; this mingpt reads 3, 4: continue it with the "
                                             r"mingpt that wrote it \(format 2: before 2026-11-24\)"):
        read_whole(store, p)


def test_retention_keeps_last_k_after_commit(store_url):
    store = SnapshotStore(store_url)
    for step in range(1, 8):
        save_state(store, step, state(step), {})
        store.prune(keep_last=2, keep_every=3)
    assert [s.step for s in store.list()] == [3, 6, 7]
    store.prune(keep_last=2)
    assert [s.step for s in store.list()] == [6, 7]


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors shaped like a model's and optimizer's: matrices, vectors, an odd row count, scalars."""
    g = torch.Generator().manual_seed(seed)
    return {"model.wte.weight": torch.randn(67, 8, generator=g), "model.ln.bias": torch.randn(8, generator=g),
            "model.h.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "optim.wte.weight.exp_avg": torch.randn(67, 8, generator=g), "optim.wte.weight.step": torch.tensor(7.0)}


def rank_slots(tensors: dict, rank: int, ranks: int) -> list:
    """Rank `rank`'s empty slots in an FSDP-like world of `ranks`: its rows (torch.chunk's rule) of
    every tensor but the scalars, which it holds whole."""
    from mingpt.parallel.shards import rows_of
    from mingpt.snapshot.layout import Slot, n_rows

    slots = []
    for name, full in tensors.items():
        start, stop = rows_of(n_rows(full.shape), ranks, rank)
        local = torch.full_like(full, -1.0) if full.dim() == 0 else torch.full_like(full[start:stop], -1.0)
        slots.append(Slot(name, local, tuple(full.shape), start if full.dim() else 0, sharded=full.dim() > 0))
    return slots


def write_sharded(store: SnapshotStore, step: int, tensors: dict, writers: int) -> str:
    """A snapshot written by `writers` writers, each with only its own ShardWriter (as the ranks do)."""
    from mingpt.snapshot.layout import Slot
    from mingpt.snapshot.snapshotter import ShardWriter

    slots = [Slot(k, v, tuple(v.shape)) for k, v in tensors.items()]
    shards = [ShardWriter(w, writers) for w in range(writers)]
    store.begin(step)
    records = [sh.write(store, step, *sh.copy(slots, {"trainer": {"step": step}})) for sh in shards]
    return store.commit(step, shards[0].manifest({"world_size": writers}, records))


def test_each_byte_is_written_once_by_balanced_writers(tmp_path):
    from mingpt.snapshot.layout import cut

    tensors = sample_state()
    pieces, sizes = cut([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], 3)
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    # torch.chunk's rule leaves the last writer at most writers - 1 rows short of the others, per tensor
    slack = sum(2 * v[0].numel() * v.element_size() if v.dim() else v.element_size() for v in tensors.values())
    assert sum(sizes) == total and max(sizes) - min(sizes) <= slack < total / 10
    for name, v in tensors.items():  # the pieces tile every tensor's rows exactly once
        rows = [r for p in pieces[name] for r in range(p.start, p.stop)]
        assert rows == list(range(v.shape[0] if v.dim() else 1))
    path = write_sharded(SnapshotStore(str(tmp_path)), 4, tensors, writers=3)
    assert sorted(p.name for p in (tmp_path / "step_000000004").iterdir()) == [
        "extra.pt", "manifest.json", "shard-00000-of-00003.bin", "shard-00001-of-00003.bin", "shard-00002-of-00003.bin"]
    read_whole(SnapshotStore(str(tmp_path)), path)  # every piece read and checked


@pytest.mark.parametrize("writers,readers", [(1, 3), (3, 2), (2, 2), (4, 1)])
def test_a_snapshot_of_n_writers_loads_into_m_shards_bitwise(store_url, monkeypatch, writers, readers):
    """Every rank of an FSDP-like world of `readers` ranks takes its rows (torch.chunk's rule) from
    the pieces of any number of writers. On S3 the pieces come in merged ranged GETs, here of at
    most 1 KB, so that a piece is also cut over several GETs."""
    from mingpt.snapshot import s3 as s3_module
    from mingpt.snapshot.restore import restore

    monkeypatch.setattr(s3_module, "READ_BYTES", 1024)
    tensors = sample_state(writers)
    store = SnapshotStore(store_url)
    path = write_sharded(store, 9, tensors, writers)
    manifest = store.read_manifest(path)
    for rank in range(readers):
        slots = rank_slots(tensors, rank, readers)
        extra = restore(store, path, manifest, slots, rank=0, world=1)
        assert extra["trainer"] == {"step": 9}
        for slot in slots:
            full = tensors[slot.name]
            assert torch.equal(slot.local, full if full.dim() == 0 else full[slot.start:slot.stop]), slot.name


@pytest.mark.parametrize("key", ["copies", "replicas"])
@pytest.mark.parametrize("readers", [1, 3, 4])
def test_an_hsdp_snapshot_is_written_once_across_copies_and_loads_at_any_size(tmp_path, readers, key):
    """HSDP, 2 nodes x 2 processes: rank w = copy * 2 + shard holds its shard's rows (the same on
    both copies of the model). Each row is written once, every writer about the same bytes, and the
    snapshot loads whole (DDP, one process) and into FSDP-like worlds of 3 and 4 ranks, bitwise; so
    does one whose manifest names the copies by their old key alone ("replicas": written before the
    rename)."""
    from mingpt.parallel.shards import rows_of
    from mingpt.snapshot.layout import n_rows
    from mingpt.snapshot.restore import restore
    from mingpt.snapshot.snapshotter import ShardWriter

    tensors, copies, shards = sample_state(3), 2, 2
    store = SnapshotStore(str(tmp_path))
    writers = [ShardWriter(w, copies * shards, copies) for w in range(copies * shards)]
    store.begin(5)
    records = []
    for w, sh in enumerate(writers):
        slots = rank_slots(tensors, w % shards, shards)
        for slot in slots:  # what this rank holds: its shard's rows, as its copy on the other node
            full = tensors[slot.name]
            slot.local.copy_(full if full.dim() == 0 else full[slot.start:slot.stop])
        for name, p in sh.own_pieces():  # within the rows it holds
            first, last = rows_of(n_rows(tensors[name].shape), shards, w % shards)
            assert first <= p.start < p.stop <= last, (w, name, p)
        records.append(sh.write(store, 5, *sh.copy(slots, {"trainer": {"step": 5}})))
    written = writers[0].manifest({"world_size": 4, "parallel": "hsdp"}, records)
    assert written["copies"] == written["replicas"] == 2  # (the old key for a mingpt before the rename)
    other = "replicas" if key == "copies" else "copies"
    path = store.commit(5, {k: v for k, v in written.items() if k != other})  # the manifest names them once
    for name, v in tensors.items():  # the pieces tile every tensor's rows exactly once
        rows = sorted(r for p in writers[0].pieces[name] for r in range(p.start, p.stop))
        assert rows == list(range(n_rows(v.shape))), name
    sizes = [r["size"] for r in records]
    slack = sum(2 * v[0].numel() * v.element_size() if v.dim() else v.element_size() for v in tensors.values())
    assert sum(sizes) == sum(v.numel() * v.element_size() for v in tensors.values())
    assert max(sizes) - min(sizes) <= slack, sizes
    manifest = store.read_manifest(path)
    assert manifest[key] == 2 and other not in manifest
    for rank in range(readers):
        slots = rank_slots(tensors, rank, readers) if readers > 1 else [
            Slot(k, torch.empty_like(v), tuple(v.shape)) for k, v in tensors.items()]
        restore(store, path, manifest, slots, rank=0, world=1)
        for slot in slots:
            full = tensors[slot.name]
            assert torch.equal(slot.local, full if full.dim() == 0 else full[slot.start:slot.stop]), slot.name


def test_a_damaged_piece_is_named_by_its_shard(tmp_path):
    from mingpt.snapshot.layout import Slot
    from mingpt.snapshot.restore import restore

    tensors = sample_state()
    store = SnapshotStore(str(tmp_path))
    path = write_sharded(store, 2, tensors, writers=2)
    shard = tmp_path / "step_000000002" / "shard-00001-of-00002.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF  # the same size, one byte changed
    shard.write_bytes(bytes(data))
    slots = [Slot(k, torch.empty_like(v), tuple(v.shape)) for k, v in tensors.items()]
    with pytest.raises(SnapshotError, match="shard-00001-of-00002.bin fails its checksum"):
        restore(store, path, store.read_manifest(path), slots, rank=0, world=1)
    with pytest.raises(SnapshotError, match="shard-00001-of-00002.bin fails its checksum"):
        read_whole(store, path)
    shard.unlink()
    assert store.missing_files(path, store.read_manifest(path)) == ["shard-00001-of-00002.bin is missing"]




def test_the_manifest_does_not_grow_with_tensors_times_writers(tmp_path):
    """One entry per tensor (no pieces) and one per file (its size, a sha256 per chunk): 32 writers
    add 31 file entries to the manifest of one, whatever the number of tensors."""
    from mingpt.snapshot.chunks import CHUNK_BYTES

    tensors = {f"model.t{i}.weight": torch.randn(64, 4) for i in range(200)}
    sizes = {}
    for writers in (1, 32):
        path = write_sharded(SnapshotStore(str(tmp_path / str(writers))), 1, tensors, writers)
        manifest = json.loads(open(f"{path}/manifest.json").read())
        assert all(set(e) == {"dtype", "shape"} for e in manifest["tensors"].values())
        shards = {k: f for k, f in manifest["files"].items() if k.startswith("shard")}
        assert len(shards) == writers and all(len(f["sha256"]) == -(-f["size"] // CHUNK_BYTES) for f in shards.values())
        sizes[writers] = len(open(f"{path}/manifest.json").read())
    assert sizes[32] - sizes[1] < 31 * 200, sizes  # about 150 bytes per file, nothing per tensor and writer


def keep_two(store: SnapshotStore, step: int) -> None:
    """Save `step` as training does: committed by a Snapshotter, then retention with keep_last=2."""
    from mingpt.snapshot import Snapshotter

    snap = Snapshotter(store, keep_last=2, retries=0)
    snap.save(step, [Slot("model.w", torch.full((4, 4), float(step)), (4, 4))], {"trainer": {"step": step}}, {})
    assert snap.wait() is True
    snap.close()


def resume(store: SnapshotStore) -> int:
    """What a start does (candidates, then newest_that_loads over real restores); the step it resumes."""
    from mingpt.snapshot.restore import restore
    from mingpt.snapshot.store import candidates, newest_that_loads

    def load(path: str, manifest: dict) -> dict:
        return restore(store, path, manifest, [Slot("model.w", torch.empty(4, 4), (4, 4))], rank=0, world=1)

    found = candidates(store, [s for s in store.list() if s.committed])
    return newest_that_loads(store, found, load, reject=True)[0]["step"]


def flip(store: SnapshotStore, step: int) -> None:
    """One byte of the snapshot's shard changed, its size kept: only a load finds out."""
    f = f"{store.root}/{store.name(step)}/{SHARD}"
    data = bytearray(fs_of(store).cat(f))
    data[3] ^= 0xFF
    fs_of(store).pipe(f, bytes(data))


def test_retention_keeps_the_newest_snapshots_that_load(store_url, caplog):
    """Issue 33's scenario: resumes fall back past damaged snapshots, more saves follow; the good
    older ones stay, so one more damaged file still leaves a snapshot to resume."""
    store = SnapshotStore(store_url)
    for step in (10, 20, 30):
        keep_two(store, step)
    flip(store, 30)
    assert resume(store) == 20
    keep_two(store, 25)  # the resumed run saves (a preemption save, say): 30 is damaged, 20 is kept
    assert [s.step for s in store.list()] == [20, 25, 30]
    flip(store, 25)
    assert resume(store) == 20
    keep_two(store, 21)
    assert [s.step for s in store.list()] == [20, 21, 25, 30]
    flip(store, 21)
    assert resume(store) == 20  # it used to be "no snapshot can be loaded": 20 had been pruned
    keep_two(store, 30)  # a step saved anew is good again, and counts: what is older than 20 and 30 goes
    keep_two(store, 40)
    assert [s.step for s in store.list()] == [30, 40]
    assert resume(store) == 40


def test_a_snapshot_with_a_missing_file_does_not_count_as_kept(store_url):
    store = SnapshotStore(store_url)
    keep_two(store, 1)
    keep_two(store, 2)
    fs_of(store).rm(f"{store.root}/{store.name(2)}/{SHARD}")
    keep_two(store, 3)
    assert [s.step for s in store.list()] == [1, 2, 3]  # 1 and 3 load; 2 never will
    assert resume(store) == 3
    keep_two(store, 4)
    assert [s.step for s in store.list()] == [3, 4]


@pytest.mark.parametrize("failures", [1, 3])
def test_a_failed_manifest_read_is_retried_then_fails_the_start(tmp_path, monkeypatch, caplog, failures):
    """A timeout reading the newest manifest must not make a start resume an older snapshot: it is
    retried, and if it persists the start fails as a transient error (exit 1, torchrun tries again),
    not as a bad snapshot or setting (SnapshotError, exit 2)."""
    from mingpt.snapshot.store import TransientError, candidates

    store = SnapshotStore(str(tmp_path))
    for step in (1, 2):
        save_state(store, step, state(step), {})
    get, left = store.files.get, [failures]

    def flaky(path: str) -> bytes:
        if path.endswith(f"{store.name(2)}/manifest.json") and left[0]:
            left[0] -= 1
            raise TimeoutError("read timed out")
        return get(path)

    monkeypatch.setattr(store.files, "get", flaky)
    committed = [s for s in store.list() if s.committed]
    if failures < 3:
        assert [m["step"] for _, m in candidates(store, committed)] == [2, 1]
        return
    with pytest.raises(TransientError, match="cannot read snapshot .*step_000000002 now .*TimeoutError") as e:
        candidates(store, committed)
    assert not isinstance(e.value, SnapshotError) and "falling back" not in caplog.text


def test_a_read_error_that_may_pass_fails_the_load_without_marking_the_snapshot(tmp_path, monkeypatch):
    from mingpt.snapshot import transport
    from mingpt.snapshot.store import REJECTED_FILE, TransientError

    store = SnapshotStore(str(tmp_path))
    keep_two(store, 1)
    keep_two(store, 2)

    def timeout(*args):
        raise TimeoutError("read timed out")

    monkeypatch.setattr(transport, "pread_into", timeout)
    with pytest.raises(TransientError, match="could not be read now"):
        resume(store)
    assert not any((tmp_path / store.name(s)).joinpath(REJECTED_FILE).exists() for s in (1, 2))
    monkeypatch.undo()
    assert resume(store) == 2


def test_unreachable_bucket_is_one_clear_error_without_credentials(s3, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the message, not botocore's 10 s of retries
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
