"""A warm spare for a replica group's process: the group's command started a second time on its node.

Each member of a replica-group job is one process at a time, and it holds its member's lock on its
node (an exclusive `flock` on a file in a directory private to the user, named by the job secret and
the member number). A second process for the same member finds the lock held: it builds everything
a start builds (config, corpus, model, optimizer), then stands by; the kernel hands it the lock the
moment the holder dies, however it dies, and the spare takes the member's place at once, joining and
healing from a live group like any returning member, without an interpreter, imports or a build on
the way. The holder's torchrun restarts its processes as usual: they find the lock taken, and stand
by in turn. A frozen or cut-off holder keeps the lock: it is left behind and comes back itself
(docs/replicas.md, "A warm spare").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from mingpt.replicas.link import ReplicaError
from mingpt.runtime.distributed import derive
from mingpt.snapshot.nodecache import UnsafeDirectory, private_dir, user_dir

log = logging.getLogger(__name__)

CHECK_S = 0.2  # how often a waiting spare asks whether to give up
_HELD: dict[Path, int] = {}  # the member locks this process holds, by path: held until it exits


def lock_path(secret: bytes, member: int, root: str | None = None) -> Path:
    """Where member `member`'s lock of the job of `secret` lives on this node, a name only the job can
    make, in a directory of this user's alone: $XDG_RUNTIME_DIR/mingpt-replicas where that is set and
    private (nobody else can make a name there), else mingpt-<uid>/replicas in the temp folder (`root`).
    Anyone can make that name first in a temp folder: then the locks go to mingpt-<uid>-<a name derived
    from the secret> beside it, with a warning; another user's folder is never used."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "") if root is None else ""
    if runtime:
        with contextlib.suppress(OSError, UnsafeDirectory):
            return _in(private_dir(private_dir(Path(runtime)) / "mingpt-replicas"), secret, member)
    temp = root or tempfile.gettempdir()
    try:
        return _in(private_dir(private_dir(user_dir(temp)) / "replicas"), secret, member)
    except (OSError, UnsafeDirectory) as e:
        instead = Path(temp) / f"{user_dir(temp).name}-{derive(secret, 'replicas-folder')[:16]}"
        try:
            folder = private_dir(instead)
        except (OSError, UnsafeDirectory) as e2:
            raise ReplicaError(f"the replica member's lock cannot be kept on this node: {e}; {e2}") from None
        log.warning("the replica member's lock is kept in %s: %s (another user may have made it first)", instead, e)
        return _in(folder, secret, member)


def _in(folder: Path, secret: bytes, member: int) -> Path:
    return folder / f"member-{derive(secret, f'replicas-member-{member}')[:24]}.lock"


class MemberLock:
    """Member `member`'s lock on this node; `take` and `wait` acquire it, the process keeps it until
    it exits."""

    def __init__(self, secret: bytes, member: int, root: str | None = None):
        self.secret, self.member, self.path = secret, member, lock_path(secret, member, root)
        # not inherited by exec'd children (os.open's default); the lock lives with this open file
        self._fd = _HELD.get(self.path) or os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def take(self) -> bool:
        """Whether this process now holds the lock (no wait); kept until the process exits."""
        if self.path in _HELD:  # (a second run assembled in one process, as tools and tests do)
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        _HELD[self.path] = self._fd
        return True

    def wait(self, stop: Callable[[], bool], check_s: float = CHECK_S) -> bool:
        """Wait for the lock until it is this process's (True), or `stop()` (asked every `check_s`) says
        to give up (False). A thread blocks in flock meanwhile: no polling, and the kernel hands the
        lock over the moment its holder's file is closed, by an exit or a SIGKILL."""
        if self.take():
            return True
        got = threading.Event()

        def block() -> None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            _HELD[self.path] = self._fd
            got.set()

        threading.Thread(target=block, daemon=True, name="member-lock").start()
        while not got.wait(check_s):
            if stop():
                return False
        return True


def release(secret: bytes, member: int, root: str | None = None) -> None:
    """At the run's end, the lock's holder removes its file (a process still waiting on it takes the
    lock, finds the run finished and ends). Never earlier: a process started after the removal would
    lock a new file while a waiter locks the old one. A holder killed leaves the file, empty, in the
    user's private directory."""
    path = lock_path(secret, member, root)
    if path in _HELD:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
