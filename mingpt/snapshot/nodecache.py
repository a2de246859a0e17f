"""The newest snapshots' files that this node wrote, kept in node-local memory (`/dev/shm`), so that a
restart on the same node (most restarts: a worker died, the node lives) reads them from RAM.

Nothing is trusted: a copy is used only at the manifest's size and every piece is checked against
its sha256. On a shared node the copies are the job's weights, so they live in a 0700 directory of
the user (refused if it is a symlink or someone else's), one directory per job, whose `.lock` the
job holds while it runs; a directory nobody holds is stale and reclaimed. Layout: docs/snapshots.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

LOCK = ".lock"


class UnsafeDirectory(OSError):
    """A directory the cache would use is not private to this user."""


def private_dir(path: Path) -> Path:
    """`path` as a directory that only this user can use: created 0700, or an existing one that is
    ours, not a symlink, and closed to others. Raises UnsafeDirectory otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)  # never follows a symlink planted under this name
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise UnsafeDirectory(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def user_dir(root: str) -> Path:
    return Path(root) / f"mingpt-{os.getuid()}"


def reclaim(root: str, keep: Path | None = None) -> list[tuple[Path, int]]:
    """Remove this user's job directories under `root` that no running process holds (their lock can
    be taken exclusively), except `keep`; returns (directory, bytes) of each one removed."""
    base = user_dir(root)
    if not base.exists():
        return []
    try:
        private_dir(base)
    except OSError:  # UnsafeDirectory included: never remove anything under a directory not ours
        return []
    removed = []
    for job in sorted(base.glob("job-*")):
        if job == keep or job.is_symlink() or not job.is_dir():
            continue
        # The node's other ranks reclaim the same directories at the same moment: under the lock,
        # one of them measures the directory and moves it aside, and removes it alone; the others
        # find it gone (ENOENT) or locked, which is no error.
        try:
            fd = os.open(job / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a job (or a reclaimer) holds it
            if not os.path.samestat(os.fstat(fd), os.lstat(job / LOCK)):
                continue  # a sibling moved the one we locked aside, and a job made the directory anew
            size = sum(f.lstat().st_size for f in job.rglob("*") if f.is_file() and not f.is_symlink())
            gone = base / f".reclaimed-{os.getpid()}-{job.name}"
            os.rename(job, gone)  # ENOENT: a sibling moved it first
        except OSError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)
        removed.append((job, size))
    for left in base.glob(".reclaimed-*"):  # by a reclaimer killed while removing
        shutil.rmtree(left, ignore_errors=True)
    return removed


class NodeCache:
    def __init__(self, root: str, store_url: str, launch_id: str, keep: int = 2):
        # restarts of one launch share the copies; another launch's are reclaimed when stale
        key = hashlib.sha256(f"{store_url.rstrip('/')}\0{launch_id}".encode()).hexdigest()[:16]
        self.dir = user_dir(root) / f"job-{key}"
        self.keep, self.enabled, self._lock = keep, True, None
        try:
            os.makedirs(root, exist_ok=True)  # /dev/shm is always there; another root may not be yet
            private_dir(user_dir(root))
            private_dir(self.dir)
            self._lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # in use: no other start reclaims it
        except OSError as e:
            self._off(f"cannot use {self.dir} ({e})")
            return
        gone = reclaim(root, keep=self.dir)
        if gone:
            log.info("node cache: reclaimed %.1f MB of stale snapshot copies (%s)",
                     sum(size for _, size in gone) / 1e6, ", ".join(p.name for p, _ in gone))

    def _off(self, why: str) -> None:
        self.enabled = False
        log.warning("node cache off: %s; restarts read snapshots from the store (set snapshot.node_cache=off to "
                    "silence this)", why)

    def folder(self, step: int) -> Path:
        return self.dir / f"step_{step:09d}"

    def put(self, step: int, name: str, data) -> None:
        """Keep a copy of one file of snapshot `step` (a failure turns the cache off, with a warning)."""
        if not self.enabled:
            return
        folder = self.folder(step)
        tmp = folder / f".{name}.{os.getpid()}"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as fh:
                fh.write(memoryview(data).cast("B"))
            os.replace(tmp, folder / name)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
            self._off(f"cannot keep {name} in {self.dir} ({e.strerror or e}; a container may need a larger "
                      "/dev/shm: docker run --shm-size=...)")
            return
        self.prune()

    def prune(self) -> None:
        """Keep the `keep` newest steps."""
        steps = sorted(p for p in self.dir.glob("step_*") if p.is_dir() and not p.is_symlink())
        for old in steps[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def file(self, step: int, name: str, size: int) -> str | None:
        """The path of the copy of `name` of snapshot `step`, if there is one of that size."""
        if not self.enabled:
            return None
        path = self.folder(step) / name
        try:
            st = os.lstat(path)
            return str(path) if stat.S_ISREG(st.st_mode) and st.st_size == size else None
        except OSError:
            return None

    def clear(self) -> None:
        """The job is done: give the node's memory back."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
