"""Bytes to and from where snapshots live: a local directory or an S3 bucket, behind one small interface.

The catalogue (store.py) decides what a snapshot is (names, manifests, commit, retention); a
`Files` here only moves bytes. `LocalFiles` writes under a temporary name, fsyncs and renames, and
reads with positioned reads straight into the caller's memory. `S3Objects` writes by PUT or a
multipart upload with several parts in flight (s3fs's, or boto3's transfer manager), and reads in a
few large ranged GETs streamed into the caller's memory. Paths are full paths in the transport's
namespace (`join(root, ...)`), never URLs.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from mingpt.runtime.storage import atomic_write_bytes

log = logging.getLogger(__name__)

READ_ATTEMPTS = 3

# A read request: (path, offset, buffer to fill). Readers return the failed ones: {index: message}.
Request = tuple[str, int, memoryview]


class ShortFileError(OSError):
    """A file ends before the bytes asked for: retrying cannot help."""


# What a read failure that names this says: the bytes could not be fetched now (a timeout, a dropped
# connection), which says nothing about the snapshot. The ranks pass failures around as text.
TRANSIENT = "a storage error that may pass"


def damaged(e: BaseException) -> bool:
    """Whether a read error means the stored bytes are bad (missing, short, unparsable): retrying
    cannot help. Anything else (a timeout, a dropped connection, a throttled request) may pass."""
    return isinstance(e, (ShortFileError, FileNotFoundError, ValueError, KeyError, TypeError))


class Files(Protocol):
    """What the snapshot catalogue needs from where the snapshots live."""

    url: str
    root: str
    local: bool

    def check(self) -> None: ...  # raise if the place is not reachable (a missing bucket, a dead endpoint)
    def put(self, path: str, data) -> None: ...  # durable, whole or not at all
    def get(self, path: str) -> bytes: ...
    def fill(self, requests: list[Request]) -> dict[int, str]: ...
    def names(self, folder: str) -> list[str]: ...  # [] when the folder is missing
    def sizes(self, folder: str) -> dict[str, int]: ...
    def exists(self, path: str) -> bool: ...
    def remove(self, path: str) -> None: ...  # a file or a whole folder; nothing if missing
    def move(self, folder: str, dest: str) -> None: ...
    def sync_dir(self, folder: str) -> None: ...  # make a rename in it durable (nothing to do on S3)
    def uploads(self, older_than_s: float) -> list[dict]: ...  # unfinished multipart uploads
    def abort_upload(self, upload: dict) -> None: ...


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def retried(fn: Callable, attempts: int = READ_ATTEMPTS, backoff_s: float = 0.5):
    """fn() again after a failure (a dropped connection, a throttled GET), with backoff: one transient
    error must not make every rank pass over the newest snapshot. A damaged file stays damaged."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if damaged(e) or attempt == attempts - 1:
                raise
            log.warning("snapshot read failed (%s: %s); retrying in %.1fs", e.__class__.__name__, e,
                        backoff_s * 2**attempt)
            time.sleep(backoff_s * 2**attempt)


def pread_into(file: str, offset: int, out: memoryview) -> None:
    """Fill `out` with the bytes of a local file from `offset` on."""
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise ShortFileError(f"{file} ends before byte {offset + len(out)}")
            done += n
    finally:
        os.close(fd)


def failure(path: str, e: Exception) -> str:
    """A read failure as text, naming the file, and TRANSIENT unless the file is damaged."""
    return (f"shard {path.rsplit('/', 1)[-1]} cannot be read ({e.__class__.__name__}: {e})"
            + ("" if damaged(e) else f"; {TRANSIENT}"))


class LocalFiles:
    local = True

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.root = os.path.abspath(self.url.removeprefix("file://"))

    def check(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def put(self, path: str, data) -> None:
        atomic_write_bytes(Path(path), memoryview(data).cast("B"))

    def get(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def fill(self, requests: list[Request]) -> dict[int, str]:
        failed: dict[int, str] = {}

        def one(i: int) -> None:
            path, offset, view = requests[i]
            try:
                retried(lambda: pread_into(path, offset, view))
            except Exception as e:  # noqa: BLE001 - any read failure names the shard
                failed[i] = failure(path, e)

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshot-read") as pool:
            list(pool.map(one, range(len(requests))))
        return failed

    def names(self, folder: str) -> list[str]:
        try:
            return os.listdir(folder)
        except FileNotFoundError:
            return []

    def sizes(self, folder: str) -> dict[str, int]:
        return {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)

    def move(self, folder: str, dest: str) -> None:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(folder, dest)

    def sync_dir(self, folder: str) -> None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def uploads(self, older_than_s: float) -> list[dict]:  # noqa: ARG002 - the store interface's
        return []

    def abort_upload(self, upload: dict) -> None:  # noqa: ARG002 - the store interface's
        raise ValueError("a local store has no multipart uploads")
