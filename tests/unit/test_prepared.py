"""Reading a prepared dataset from S3 while training: an error that may pass is retried, and one
that persists stops the run as a transient error (exit 1: torchrun restarts it), never as bad
input (DataError, exit 2)."""

import time
import uuid

import numpy as np
import pytest
from conftest import SMALL, gpt2_ranks

from mingpt.config.schema import DataConfig, TokenizerConfig
from mingpt.data import DataError, load_corpus
from mingpt.data.prepare import Settings, prepare
from mingpt.data.prepared import PreparedData, ShardCache, StreamError


@pytest.fixture
def remote(tmp_path, s3, monkeypatch):
    """A dataset on the S3 server, opened with its background copy off: every read is a ranged GET."""
    import s3fs

    s3fs.S3FileSystem().mkdir(bucket := f"prep-flaky-{uuid.uuid4().hex[:8]}")
    (tmp_path / "in.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    prepare([str(tmp_path / "in.txt")], f"s3://{bucket}/ds", Settings(unit_bytes=8192, shard_bytes=4096), kind="char",
            workers=1)
    monkeypatch.setattr(ShardCache, "try_get", lambda self, entry: False)
    ds = PreparedData(f"s3://{bucket}/ds", str(tmp_path / "cache"), 1)
    yield ds
    ds.close()


def failing(fs, monkeypatch, times: int, error: Exception) -> None:
    """The file system's reads fail `times` times with `error`, then work."""
    cat_file, left = fs.cat_file, [times]

    def flaky(*args, **kwargs):
        if left[0]:
            left[0] -= 1
            raise error
        return cat_file(*args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", flaky)


def test_a_dropped_read_is_retried(remote, monkeypatch):
    n = len(remote.tokens)
    expected = remote.tokens.read(0, n).copy()
    failing(remote.place.fs, monkeypatch, 2, TimeoutError("read timed out"))
    assert np.array_equal(remote.tokens.read(0, n), expected)


def test_a_read_that_keeps_failing_is_a_transient_error_not_bad_input(remote, monkeypatch):
    from mingpt.main import USER_ERRORS

    failing(remote.place.fs, monkeypatch, 3, TimeoutError("read timed out"))
    with pytest.raises(StreamError, match=r"reading prep-flaky-\w+/ds/.* failed 3 times \(TimeoutError: read timed out\); "
                                          "exiting so that torchrun restarts the workers") as e:
        remote.tokens.read(0, 10)
    assert not isinstance(e.value, USER_ERRORS)  # main.py: exit 1, not 2


def test_a_missing_shard_is_still_bad_input(remote, monkeypatch):
    failing(remote.place.fs, monkeypatch, 1, FileNotFoundError("prep-flaky/ds/shards/x.bin"))
    with pytest.raises(DataError, match=r"cannot reach prep-flaky-\w+/ds/"):
        remote.tokens.read(0, 10)


def test_a_cache_limit_beyond_the_disk_is_refused(inputs, tmp_path, s3, monkeypatch):
    import shutil

    import s3fs

    s3fs.S3FileSystem().mkdir("prep-disk")
    m = prepare([str(inputs / "b.jsonl")], "s3://prep-disk/ds", SMALL, ranks_file=gpt2_ranks(), workers=1)
    d = DataConfig(path="s3://prep-disk/ds", cache_dir=str(tmp_path / "cache"), shard_cache_gb=1e9,
                   tokenizer=TokenizerConfig("bpe", gpt2_ranks()))
    load_corpus(d).close()  # a limit larger than any disk, but the dataset is small: only what it needs counts
    small_disk = shutil.disk_usage(tmp_path)._replace(free=sum(s["bytes"] for s in m["shards"]) // 2)
    monkeypatch.setattr("mingpt.data.prepared.shutil.disk_usage", lambda path: small_disk)
    with pytest.raises(DataError, match=r"needs 0.0 GiB \(data.shard_cache_gb=1e\+09\) but its disk has 0.0 GiB free; "
                                        "lower data.shard_cache_gb or point data.cache_dir at a larger disk"):
        load_corpus(DataConfig(path="s3://prep-disk/ds", cache_dir=str(tmp_path / "cache2"), shard_cache_gb=1e9,
                               tokenizer=TokenizerConfig("bpe", gpt2_ranks())))


def test_the_shard_cache_keeps_its_limit_evicting_the_least_recently_used(inputs, tmp_path, s3):
    import s3fs

    from mingpt.data.prepare import DatasetDir
    from mingpt.data.prepared import ShardCache

    fs = s3fs.S3FileSystem()
    fs.mkdir("prep-lru")
    m = prepare([str(inputs / "b.jsonl")], "s3://prep-lru/ds", Settings(unit_bytes=8192, shard_bytes=512),
                ranks_file=gpt2_ranks(), workers=1)
    a, b, c = [s for s in m["shards"] if s["bytes"] == 512][:3]  # three of the same size
    cache = ShardCache(DatasetDir("s3://prep-lru/ds"), tmp_path / "cache", limit=a["bytes"] + b["bytes"])
    cached = lambda: sorted(p.name for p in (tmp_path / "cache").glob("*.bin"))  # noqa: E731
    pa = cache.get(a)
    time.sleep(0.01)
    cache.get(b)
    time.sleep(0.01)
    assert cache.get(a) == pa  # a is used again: b is now the least recently used
    cache.get(c)
    names = [s["name"].replace("/", "__") for s in (a, b, c)]
    assert cached() == sorted([names[0], names[2]]) and cache.usage() <= cache.limit
    assert np.fromfile(pa, dtype=np.uint16).nbytes == a["bytes"]


def test_the_shard_cache_survives_a_copy_vanishing_under_another_local_rank(inputs, tmp_path, s3,
                                                                             monkeypatch):
    """Local ranks share the cache and each evicts: a file listed by one may be gone when it looks at
    it. Usage and eviction go on (they used to raise FileNotFoundError from stat)."""
    from pathlib import Path

    import s3fs

    from mingpt.data.prepare import DatasetDir
    from mingpt.data.prepared import ShardCache

    s3fs.S3FileSystem().mkdir("prep-race")
    m = prepare([str(inputs / "b.jsonl")], "s3://prep-race/ds", Settings(unit_bytes=8192, shard_bytes=512),
                ranks_file=gpt2_ranks(), workers=1)
    a, b, c = [s for s in m["shards"] if s["bytes"] == 512][:3]
    cache = ShardCache(DatasetDir("s3://prep-race/ds"), tmp_path / "cache", limit=a["bytes"] + b["bytes"])
    cache.get(a)
    cache.get(b)
    glob, is_file, gone = Path.glob, Path.is_file, []

    def racing_glob(self, pattern):  # another rank removes the first copy right after it was listed
        found = list(glob(self, pattern))
        if self == cache.dir and found:
            found[0].unlink(missing_ok=True)
            gone.append(found[0])
        return iter(found)

    monkeypatch.setattr(Path, "glob", racing_glob)
    monkeypatch.setattr(Path, "is_file", lambda self: self in gone or is_file(self))  # it was there when checked
    assert cache.usage() <= a["bytes"] + b["bytes"]
    assert cache.get(c).stat().st_size == c["bytes"]  # evicts among files that vanish meanwhile


def test_a_failing_background_copy_is_reported_by_the_next_read(inputs, tmp_path, s3, monkeypatch):
    """An unexpected error in the thread that copies shards (a full disk, a bug) stops the run at the
    next read, named; it used to end the thread silently."""
    import s3fs

    from mingpt.data.prepared import ShardCache

    s3fs.S3FileSystem().mkdir("prep-thread")
    m = prepare([str(inputs / "b.jsonl")], "s3://prep-thread/ds", SMALL, ranks_file=gpt2_ranks(), workers=1)

    def broken(self, entry):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardCache, "try_get", broken)
    ds = PreparedData("s3://prep-thread/ds", str(tmp_path / "cache"), 1)
    deadline = time.monotonic() + 30
    with pytest.raises(DataError, match="No space left on device"):
        while time.monotonic() < deadline:
            ds.tokens.read(0, m["tokens"])
            time.sleep(0.05)
    ds.close()
