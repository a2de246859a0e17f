"""One live job per snapshot store: a lease file in the store (local disk or S3, through the store's
transport) that the first rank takes before choosing where to start, renews from a background
thread and releases at exit.

Another launch is refused while the lease is live. The same launch (a torchrun restart, or the
other replica groups of one job, which hold it together) takes it over at once; a lease that was
not renewed in time, or whose process is known to be gone (same
host and pid namespace), is taken over with a warning: a dead job cannot hold a store forever.

A holder that finds, when it renews, that another process of its own launch took the lease over
while it still runs is a world that torchrun's rendezvous has left behind: a node whose heartbeats
were missed formed a world of its own while the others went on (a split brain), and both would write
into one store. It calls `on_superseded` (the trainer: stop, so that torchrun restarts its workers
and its node rejoins the others). Replica groups share the lease (`shared`): no such check.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from mingpt.snapshot.store import SnapshotError, SnapshotStore
from mingpt.snapshot.transport import join

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
# Two launches that both found the store free write one after the other; reading back after this
# pause, the first sees the second's lease and stops.
SETTLE_S = 0.5


class LeaseError(SnapshotError):
    """Another live job holds the store; the message says which and what to do."""


class Lease:
    def __init__(self, store: SnapshotStore, launch_id: str, ttl_s: float, shared: bool = False,
                 on_superseded: Callable[[], None] | None = None):
        self.store, self.launch_id, self.ttl_s = store, launch_id, ttl_s
        self.shared, self.on_superseded = shared, on_superseded
        self.path = join(store.root, LEASE_FILE)
        self.record = {"launch_id": launch_id, "host": socket.gethostname(), "pid": os.getpid(), "pidns": _pidns(),
                       "since": time.time(), "token": uuid.uuid4().hex, "ttl_s": ttl_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> Lease:
        """Hold the store's lease from now on, or raise LeaseError if another live job holds it."""
        held = self._read()
        if held and held.get("launch_id") != self.launch_id:
            if held["expires"] > time.time() and not _gone(held):
                raise LeaseError(_in_use(self.store.url, held))
            log.warning("snapshot store %s: taking over the lease of job %s on host %s (pid %s), %s",
                        self.store.url, held["launch_id"], held["host"], held["pid"],
                        "whose process is gone" if _gone(held) else "which it did not renew in time")
        self._write()
        if not held or held.get("launch_id") != self.launch_id:
            time.sleep(SETTLE_S)
            now = self._read()
            if now and now.get("launch_id") != self.launch_id:  # another launch wrote last (one of ours may have)
                raise LeaseError(_in_use(self.store.url, now))
        self._thread = threading.Thread(target=self._renew, name="snapshot-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._read().get("token") == self.record["token"]:
                self.store.files.remove(self.path)
            if self.store.local and not self.store.files.names(self.store.root):  # a start that failed: no
                os.rmdir(self.store.root)  # empty store left behind (the first save makes it again)
        except Exception as e:  # noqa: BLE001 - exiting anyway; the lease expires by itself
            log.warning("could not release the lease of snapshot store %s (%s: %s); it expires in %g s",
                        self.store.url, e.__class__.__name__, e, self.ttl_s)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):  # a few tries before it expires
            try:
                held = self._read()
                if held and held.get("launch_id") != self.launch_id:
                    log.error("the lease of snapshot store %s was taken over by job %s on host %s (pid %s): two "
                              "jobs now write there", self.store.url, held.get("launch_id"), held.get("host"),
                              held.get("pid"))
                    return
                if held and not self.shared and held.get("token") != self.record["token"]:
                    log.error("another world of this job (launch %s) took over snapshot store %s while this one runs "
                              "(host %s, pid %s): torchrun's rendezvous went on without this node; stopping this "
                              "world so that its node rejoins the other", self.launch_id, self.store.url,
                              held.get("host"), held.get("pid"))
                    if self.on_superseded is not None:
                        self.on_superseded()
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - a transient store error: the next try may pass
                log.warning("could not renew the lease of snapshot store %s (%s: %s)", self.store.url,
                            e.__class__.__name__, e)

    def _write(self) -> None:
        self.store.files.put(self.path, json.dumps({**self.record, "expires": time.time() + self.ttl_s}).encode())

    def _read(self) -> dict:
        try:
            return json.loads(self.store.files.get(self.path))
        except FileNotFoundError:
            return {}


def _in_use(url: str, held: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
    return (f"snapshot store {url} is in use by job {held['launch_id']} on host {held['host']} (pid {held['pid']}) "
            f"since {since}; wait for it, or use another trainer.run_dir / snapshot.dir; a dead job's lease expires "
            f"after {held['ttl_s']:g} s")


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux
        return None


def _gone(held: dict) -> bool:
    """Whether the holder's process is known to be gone: only on its own host and pid namespace."""
    if held.get("host") != socket.gethostname() or held.get("pidns") is None or held.get("pidns") != _pidns():
        return False
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process with that pid: alive
        pass
    return False
