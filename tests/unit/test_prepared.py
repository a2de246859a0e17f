"""Reading a prepared dataset from S3 while training: an error that may pass is retried, and one
that persists stops the run as a transient error (exit 1: torchrun restarts it), never as bad
input (DataError, exit 2)."""

import uuid

import numpy as np
import pytest

from mingpt.data import DataError
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
