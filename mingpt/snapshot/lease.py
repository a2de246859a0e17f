"""One live job per snapshot store: a lease file in the store (local disk or S3, through the store's
transport) that the first rank takes before choosing where to start, renews from a background
thread and releases at exit.

Another launch is refused while the lease is live. The same launch (a torchrun restart, or the
other replica groups of one job, which hold it together) takes it over at once; a lease that was
not renewed in time, or whose process is known to be gone (same
host and pid namespace), is taken over with a warning: a dead job cannot hold a store forever.
A launch id is one launch's (mingpt/cli/launch_id.py: a nonce per launch), so a second launch with
the same job secret is another launch and refused. Another launch of the same job (`job`, derived
from the secret: a SLURM requeue after a node was lost) waits the old lease out instead: refused if
its holder renews it while it waits, taken over once it expires. Replica groups are one launch: their
id is the job's (mingpt/training/replica_launch.py as_member), so a second replica job with the same secret
is not refused by the lease; a secret per job is what keeps two replica jobs apart.

A holder that finds, when it renews or just before it commits a snapshot (`check`), that another
launch took the lease over (it was frozen or cut off past `ttl_s`) stops at once: `on_lost`, which
exits with Exit.LEASE_LOST (mingpt/runtime/exits.py) without committing, and which torchrun does not retry.

A holder that finds that another process of its own launch took the lease over
while it still runs is a world that torchrun's rendezvous has left behind: a node whose heartbeats
were missed formed a world of its own while the others went on (a split brain), and both would write
into one store. It calls `on_superseded` (the trainer: stop, so that torchrun restarts its workers
and its node rejoins the others). Replica groups share the lease (`shared`): no such check.

Whichever started last keeps the store: a record older than its own (`since`) that it finds over its
lease is the renewal of the holder it took over from, which read the lease just before the take-over
and wrote just after; it writes its own again, and that holder finds it at its next look and stops.
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
                 on_superseded: Callable[[], None] | None = None, job: str | None = None,
                 on_lost: Callable[[str], None] | None = None):
        self.store, self.launch_id, self.ttl_s = store, launch_id, ttl_s
        self.shared, self.on_superseded, self.on_lost = shared, on_superseded, on_lost
        self.path = join(store.root, LEASE_FILE)
        self.record = {"launch_id": launch_id, "job": job, "host": socket.gethostname(), "pid": os.getpid(), "pidns": _pidns(),
                       "since": time.time(), "token": uuid.uuid4().hex, "ttl_s": ttl_s}
        self._stop, self._told = threading.Event(), threading.Lock()
        self._thread: threading.Thread | None = None

    def take(self) -> Lease:
        """Hold the store's lease from now on, or raise LeaseError if another live job holds it."""
        held = self._read()
        if held and held.get("launch_id") != self.launch_id and held.get("job") and held["job"] == self.record["job"]:
            held = self._wait_out(held)
        if held and held.get("launch_id") != self.launch_id:
            if held["expires"] > time.time() and not _gone(held):
                raise LeaseError(_in_use(self.store.url, held))
            log.warning("snapshot store %s: taking over the lease of job %s on host %s (pid %s), %s",
                        self.store.url, held["launch_id"], held["host"], held["pid"],
                        "whose process is gone" if _gone(held) else "which it did not renew in time")
        self.record["since"] = time.time()
        self._write()
        if not held or held.get("launch_id") != self.launch_id:
            time.sleep(SETTLE_S)
            now = self._read()
            if now and now.get("launch_id") != self.launch_id:  # another launch wrote last (one of ours may have)
                raise LeaseError(_in_use(self.store.url, now))
        self._thread = threading.Thread(target=self._renew, name="snapshot-lease", daemon=True)
        self._thread.start()
        return self

    def _wait_out(self, held: dict) -> dict:
        """Another launch of this job holds the lease: a requeue's dead predecessor, or a second launch
        with the same secret. Wait until it expires (returned, to be taken over) or is renewed (refused)."""
        log.warning("snapshot store %s: another launch of this job (%s on host %s, pid %s) holds the lease; waiting up "
                    "to %.0f s for it to expire", self.store.url, held["launch_id"], held["host"], held["pid"],
                    max(0.0, held["expires"] - time.time()))
        while held and held.get("launch_id") != self.launch_id and held["expires"] > time.time() and not _gone(held):
            time.sleep(min(1.0, self.ttl_s / 8, max(0.01, held["expires"] - time.time())))
            now = self._read()
            if now and (now.get("token"), now.get("expires")) != (held.get("token"), held.get("expires")):
                raise LeaseError(_in_use(self.store.url, now, " (another launch of this job, live: it renewed "
                                                              "its lease; make a secret per job)"))
            held = now
        return held

    def check(self) -> bool:
        """Whether the lease is still this job's, just before a commit; if another launch took it over
        (or another world of this launch), says so through on_lost (on_superseded) and returns False."""
        held = self._read()
        lost = held and held.get("launch_id") != self.launch_id
        superseded = held and not self.shared and held.get("token") != self.record["token"]
        if not (lost or superseded):
            return True
        if held.get("since", float("inf")) < self.record["since"] and not self._stop.is_set():
            self._write()  # the holder this one took over from wrote last: its renewal read the lease just
            return True    # before this one's take-over and wrote just after; its next look finds this one's
        with self._told:  # the renewing thread and a commit may both find it: one says so
            if not self._stop.is_set():
                self._stop.set()
                self._lost(held) if lost else self._superseded(held)
        return False

    def _lost(self, held: dict) -> None:
        why = (f"the lease of snapshot store {self.store.url} was taken over by job {held.get('launch_id')} on host "
               f"{held.get('host')} (pid {held.get('pid')}): this job was frozen or cut off past snapshot.lease_s="
               f"{self.ttl_s:g} s; stopping without saving, so that one job writes there. If that job is a new "
               "attempt of this one, nothing is lost but the steps since the last snapshot; if not, give one of "
               "them another trainer.run_dir / snapshot.dir")
        if self.on_lost is not None:
            self.on_lost(why)
        else:
            log.error("%s", why)

    def _superseded(self, held: dict) -> None:
        log.error("another world of this job (launch %s) took over snapshot store %s while this one runs (host %s, "
                  "pid %s): torchrun's rendezvous went on without this node; stopping this world so that its node "
                  "rejoins the other", self.launch_id, self.store.url, held.get("host"), held.get("pid"))
        if self.on_superseded is not None:
            self.on_superseded()

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
                if not self.check():
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


def _in_use(url: str, held: dict, which: str = "") -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
    return (f"snapshot store {url} is in use by job {held['launch_id']}{which} on host {held['host']} (pid "
            f"{held['pid']}) since {since}; wait for it, or use another trainer.run_dir / snapshot.dir; a dead job's "
            f"lease expires after {held['ttl_s']:g} s")


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
