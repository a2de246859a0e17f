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


# The process's umask, read once at import (reading it means setting it, which threads must not race).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# trainer.readable_by: who may read what a run writes on its node (folders 0777, files 0666, less the umask)
UMASKS = {"user": 0o077, "group": 0o027, "all": 0o022}


def set_umask(readable_by: str) -> None:
    """The process's umask from now on, from trainer.readable_by; called at a run's start, before any
    thread writes."""
    global _UMASK
    _UMASK = UMASKS[readable_by]
    os.umask(_UMASK)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename: never a half file. The file
    gets the usual permissions (0666 less the umask), not the temporary file's private 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
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
