"""The node cache: each writer's copy of the newest snapshots in node-local memory, trusted only
through the manifest's checksums."""

import logging

import pytest
import torch
from conftest import fs_of

from mingpt.snapshot import SnapshotError, SnapshotStore, Snapshotter
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.nodecache import NodeCache, reclaim, user_dir
from mingpt.snapshot.restore import read_whole, restore

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


def test_a_restart_reads_the_node_copy_and_falls_back_to_the_store_chunk_by_chunk(store_url, tmp_path, caplog):
    store = SnapshotStore(store_url)
    cache = NodeCache(str(tmp_path / "shm"), store.url, "job1")
    for step in (1, 2, 3):
        manifest, path = save(store, cache, step)
    assert sorted(p.name for p in cache.dir.glob("step_*")) == ["step_000000002", "step_000000003"]  # the 2 newest
    copy = cache.folder(3) / SHARD
    assert copy.read_bytes() == fs_of(store).cat_file(f"{path}/{SHARD}")
    # the store's shard damaged, the node's copy intact: loaded from the copy, bitwise
    good = fs_of(store).cat_file(f"{path}/{SHARD}")
    flip_byte(lambda b: fs_of(store).pipe_file(f"{path}/{SHARD}", b), good)
    with caplog.at_level(logging.INFO, logger="mingpt.snapshot.chunks"):
        extra, got = load(store, path, manifest, cache)
    assert extra["trainer"] == {"step": 3} and all(torch.equal(got[k], v) for k, v in tensors(3).items())
    assert "node cache: 1 of 1 chunks read from" in caplog.text
    # the copy damaged, the store intact: the store answers
    fs_of(store).pipe_file(f"{path}/{SHARD}", good)
    flip_byte(copy.write_bytes, good)
    extra, got = load(store, path, manifest, cache)
    assert all(torch.equal(got[k], v) for k, v in tensors(3).items())
    # both damaged: the snapshot is damaged, and its shard is named
    flip_byte(lambda b: fs_of(store).pipe_file(f"{path}/{SHARD}", b), good)
    with pytest.raises(SnapshotError, match=f"{SHARD} fails its checksum"):
        load(store, path, manifest, cache)


def test_a_node_without_room_turns_the_cache_off_and_saves_go_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")  # the cache cannot create its folder under a file: like a full /dev/shm
    store = SnapshotStore(str(tmp_path / "snapshots"))
    cache = NodeCache(str(blocker), store.url, "job1")
    with caplog.at_level(logging.WARNING):
        manifest, path = save(store, cache, 4)
    assert not cache.enabled and "node cache off: cannot use" in caplog.text
    assert store.list()[-1].committed and read_whole(store, path)
    _, got = load(store, path, manifest, cache)
    assert all(torch.equal(got[k], v) for k, v in tensors(4).items())


@pytest.fixture
def shm(tmp_path_factory):
    """A directory like /dev/shm: every user may create entries, only their owner may remove them."""
    import os
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user (CI and the dev machines run as root)")
    d = tempfile.mkdtemp(prefix="mingpt-shm-")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_copies_are_private_to_the_user(shm, tmp_path):
    """Another user on the node can neither read the copies nor list them (they hold the weights
    and the optimizer state)."""
    import os
    import stat
    import subprocess

    from conftest import as_nobody

    store = SnapshotStore(str(tmp_path / "snapshots"))
    cache = NodeCache(shm, store.url, "job1")
    save(store, cache, 1)
    copy = cache.folder(1) / SHARD
    assert copy.is_file()
    for p in (copy.parent, cache.dir, cache.dir.parent):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700, p
    assert stat.S_IMODE(os.lstat(copy).st_mode) == 0o600
    other = subprocess.run(["cat", str(copy)], preexec_fn=as_nobody(), capture_output=True)
    assert other.returncode != 0 and b"Permission denied" in other.stderr


def test_a_path_planted_by_another_user_is_refused_and_nothing_is_written_through_it(shm, tmp_path, caplog):
    """Another user creates the cache's directories first, with symlinks to a file of ours: the job
    refuses them (the cache goes off with a warning, saving goes on) and the file is untouched."""
    import hashlib
    import os
    import subprocess

    from conftest import as_nobody

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    store = SnapshotStore(str(tmp_path / "snapshots"))
    older = f"mingpt-snapshots-{os.getuid()}-{hashlib.sha1(store.url.encode()).hexdigest()[:12]}"  # earlier layout
    plant = (f"umask 022; for d in {shm}/{older}/step_000000001 {shm}/mingpt-{os.getuid()}; do mkdir -p $d; "
             f"ln -s {victim} $d/{SHARD}; done")
    subprocess.run(["sh", "-c", plant], preexec_fn=as_nobody(), check=True)
    with caplog.at_level(logging.WARNING):
        cache = NodeCache(shm, store.url, "job1")
        manifest, path = save(store, cache, 1)
    assert not cache.enabled and "belongs to uid 65534" in caplog.text
    assert victim.read_bytes() == b"precious"
    assert read_whole(store, path)


def test_stale_copies_are_reclaimed_by_the_next_job_and_by_the_command(shm, tmp_path):
    """A job that failed or was cancelled leaves its copies; the next start of any job of the user
    reclaims them, a running job's copies stay, and `mingpt-snapshot clean-cache` does the same."""
    from mingpt.cli.snapshot import main as snapshot_cli

    store = SnapshotStore(str(tmp_path / "snapshots"))
    running = NodeCache(shm, store.url, "running-job")
    save(store, running, 1)
    dead = NodeCache(shm, store.url, "dead-job")
    save(store, dead, 2)
    dead.close()  # the process died: its lock is gone, its files stay
    assert dead.dir.exists() and running.dir.exists()
    new = NodeCache(shm, store.url, "new-job")
    assert not dead.dir.exists(), "a failed job's copies were left in memory"
    assert running.dir.exists() and new.dir.exists()
    new.close()
    running.close()
    assert snapshot_cli(["clean-cache", "--dir", shm]) == 0
    assert not running.dir.exists() and not new.dir.exists()


def _reclaim_at_once(root, barrier, out):
    barrier.wait()  # every process starts reclaiming at the same moment
    out.put([p.name for p, _ in reclaim(root)])


def test_the_ranks_of_a_node_reclaim_the_same_stale_directories_at_once(tmp_path):
    """Issue 33: local ranks reclaiming the same stale directory crashed at start (3 of 20 tries).
    Six processes reclaim four stale directories at once, 20 times: none fails, each directory is
    removed once, and the directory of a running job stays."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    root = str(tmp_path / "shm")
    running = NodeCache(root, "/store", "running")  # holds its lock, like a live job
    running.put(1, SHARD, b"live" * 1000)
    for attempt in range(20):
        stale = [f"job-dead-{attempt}-{j}" for j in range(4)]
        for name in stale:  # what a job killed mid-run leaves: nobody holds its lock
            for step in (1, 2):
                folder = user_dir(root) / name / f"step_{step:09d}"
                folder.mkdir(parents=True)
                for shard in range(16):
                    (folder / f"shard-{shard:05d}-of-00016.bin").write_bytes(b"x" * 4096)
            (user_dir(root) / name / ".lock").touch()
        barrier, out = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_reclaim_at_once, args=(root, barrier, out)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert [p.exitcode for p in procs] == [0] * 6, f"attempt {attempt}: a reclaiming process failed"
        assert sorted(name for _ in procs for name in out.get()) == stale  # each removed by one process
        assert sorted(p.name for p in user_dir(root).iterdir()) == [running.dir.name]
        assert (running.folder(1) / SHARD).read_bytes() == b"live" * 1000
    (user_dir(root) / ".reclaimed-123-job-x" / "step_000000001").mkdir(parents=True)  # its reclaimer was killed
    reclaim(root)
    assert sorted(p.name for p in user_dir(root).iterdir()) == [running.dir.name]
