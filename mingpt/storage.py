"""Local files that must never be seen half-written, node-local locks, and the one test of whether
a path is local: shared by the data caches and the snapshot store."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def is_local(path: str) -> bool:
    """A path on this machine's file system (no URL scheme, or file://)."""
    return "://" not in path or path.startswith("file://")


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on a node-local file: the first process on a node does the work,
    the others wait and then find it done. Keyed by the path, never by RANK."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1).encode())
