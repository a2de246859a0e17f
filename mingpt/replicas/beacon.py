"""The beacon of a replica group: heartbeats to and from every other group, join requests, and
the epochs their coordinator (the lowest group alive) forms. See mingpt/replicas/__init__.py."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from mingpt.trust import bound_store, derive

log = logging.getLogger(__name__)


class MembershipChanged(Exception):
    """A member was lost (or left) during a step: the step in flight is dropped."""


class ReplicaError(RuntimeError):
    """Replica groups cannot work as configured; the message says what to change."""


@dataclass(frozen=True)
class Member:
    group: int
    incarnation: str  # this process's start: a restarted group is a new member
    step: int  # the steps its state holds
    live: bool  # it has trained in an epoch (its state is the job's, not a snapshot's)


@dataclass
class Epoch:
    number: int
    members: list[Member]  # in rank order (by group)
    rank: int
    pg: object = None  # the epoch's gloo process group
    store: object = None  # kept alive with the group (the coordinator hosts it)
    peers: object = None  # sharded groups: the process group of the members holding this one's shard

    @property
    def world(self) -> int:
        return len(self.members)

    def groups(self) -> list[int]:
        return [m.group for m in self.members]

    def holders(self, member: int, procs: int) -> list[Member]:
        """The members that hold `member`'s shard in sharded groups of `procs` processes: the same
        process of every group."""
        return [m for m in self.members if m.group % procs == member % procs]


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ReplicaError(f"replicas.peers entry {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class Beacon:
    """This group's endpoint: a server on its own peers address (heartbeats and join requests from
    the other groups) and a sender to every other group (heartbeats, join requests, their replies)."""

    def __init__(self, peers: list[str], group: int, secret: bytes, heartbeat_s: float, lost_after_s: float,
                 procs: int = 1, sharded: bool = False):
        # with several processes per group (`procs`), each process is a member: `peers` lists every
        # member's address and `group` is this member's place in it (group * procs + process);
        # `sharded`: the group's processes shard the model (FSDP), and each epoch also gets a process
        # group per process index (the members that hold the same shard)
        self.peers, self.group, self.secret, self.procs = [host_port(p) for p in peers], group, secret, procs
        self.sharded = sharded and procs > 1
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self.incarnation = secrets.token_hex(6)
        self.status = {"state": "starting", "epoch": -1, "step": 0, "taking": -1}  # then forming, training
        self.max_epoch = -1
        self._lock = threading.Lock()
        self._send_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per connection
        self._seen: dict[int, dict] = {}  # group -> its last heartbeat (with "t" and "eof")
        self._requests: dict[int, tuple[dict, socket.socket]] = {}  # join requests, to the coordinator
        self._replies: dict[str, dict] = {}  # replies to our join requests, by request id
        self._announced: dict | None = None  # the epoch this coordinator announced, until its group is made
        self._senders: dict[int, socket.socket] = {}
        self._stop = threading.Event()
        self._told_size = False  # a peer of another size of job was named once (its sender retries every heartbeat)
        host, port = self.peers[group]
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._server = socket.socket(family, kind, proto)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind(address)  # this address only: nothing listens wider than it must
        except OSError as e:
            raise ReplicaError(f"replica {self.name(group)} cannot listen on {host}:{port} ({e.strerror}): give "
                               "replicas.peers an address of this host with a free port"
                               + (f" (and the {procs - 1} after it)" if procs > 1 else "")) from None
        self._server.listen(64)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads += [threading.Thread(target=self._send, args=(g,), daemon=True)
                          for g in range(len(self.peers)) if g != group]
        for t in self._threads:
            t.start()

    # --- what the trainer asks -------------------------------------------------------------------
    def name(self, member: int) -> str:
        """A member as the logs name it: "group 2", or "group 2 process 1" with several per group."""
        return f"group {member}" if self.procs == 1 else f"group {member // self.procs} process {member % self.procs}"

    def was_lost(self, member: int) -> bool:
        """Whether `member` was heard from and is lost now (its connection broke, or it went silent)."""
        with self._lock:
            s = self._seen.get(member)
            return s is not None and (s["eof"] or time.monotonic() - s["t"] >= self.lost_after_s)

    def siblings(self, member: int) -> range:
        """The members of `member`'s group (itself included)."""
        first = member - member % self.procs
        return range(first, first + self.procs)

    def broken(self) -> set[int]:
        """Members whose group lost a process: they leave with it (its torchrun restarts them all)."""
        return {m for m in range(len(self.peers)) if any(self.was_lost(s) for s in self.siblings(m))}

    def alive(self) -> dict[int, str]:
        """{group: incarnation} of every group heard from within lost_after_s, this one included."""
        now = time.monotonic()
        with self._lock:
            out = {g: s["inc"] for g, s in self._seen.items() if not s["eof"] and now - s["t"] < self.lost_after_s}
        out[self.group] = self.incarnation
        return out

    def lost(self, epoch: Epoch) -> str | None:
        """Why `epoch` cannot go on (a member lost or gone to form another), or None."""
        alive = self.alive()
        with self._lock:
            seen = {g: dict(s) for g, s in self._seen.items()}
        others = [m for m in epoch.members if m.group != self.group]
        for m in others:  # a lost member first: it is the cause, the others leaving only follow it
            if alive.get(m.group) != m.incarnation:
                return f"{self.name(m.group)} lost"
        for m in others:
            s = seen[m.group]
            if (s.get("epoch") != epoch.number or s.get("state") != "training") and s.get("epoch", -1) >= epoch.number:
                # (a heartbeat of the previous epoch may be late); it left for the cause it saw first
                return f"{self.name(m.group)} left epoch {epoch.number}" + (f" ({s['why']})" if s.get("why") else "")
        return None

    def joiners(self, epoch: Epoch) -> list[int]:
        """Members alive that are not members of `epoch` (a restarted group, a healed partition), once
        their whole group is ready: a group's processes join together, in one new epoch."""
        mine = {m.group: m.incarnation for m in epoch.members}
        alive = self.alive()
        with self._lock:
            starting = {g for g, s in self._seen.items() if s.get("state") == "starting"}
        ready = {g for g, inc in alive.items() if mine.get(g) != inc and g not in starting}
        return sorted(g for g in ready
                      if all(s in ready or (s in alive and mine.get(s) == alive[s]) for s in self.siblings(g)))

    def _not_taking(self, epoch: Epoch) -> int | None:
        """A member whose heartbeats do not say it takes part in forming `epoch` (it missed the news)."""
        with self._lock:
            for m in epoch.members:
                seen = self._seen.get(m.group, {})
                if m.group != self.group and seen.get("taking") != epoch.number and seen.get("epoch") != epoch.number:
                    return m.group
        return None

    def set_status(self, **kw) -> None:
        with self._lock:
            self.status.update(kw)
            if "epoch" in kw:
                self.max_epoch = max(self.max_epoch, kw["epoch"])

    def close(self) -> None:
        self._stop.set()
        for s in [self._server, *self._senders.values()]:
            try:
                s.close()
            except OSError:
                pass

    # --- forming an epoch -------------------------------------------------------------------------
    def form(self, step: int, live: bool, min_groups: int, timeout_s: float,
             should_stop: Callable[[], bool], why: str = "") -> Epoch | None:
        """Join the next epoch: ask the coordinator (the lowest group alive) until it forms one that
        holds at least `min_groups` groups; then make the epoch's process group. None: `should_stop`.
        `why` the last epoch ended, told to the others in the heartbeats (its root cause only)."""
        self.set_status(state="forming", step=step,
                        why=re.sub(r"^group \d+( process \d+)? left epoch \d+ \((.*)\)$", r"\2", why))
        waited = time.monotonic()
        while True:
            if should_stop():
                return None
            coordinator = min(self.alive())
            try:
                epoch = (self._coordinate(step, live, min_groups, timeout_s) if coordinator == self.group
                         else self._ask(coordinator, step, live))
            except OSError:
                epoch = None
            if epoch is not None:
                self.set_status(taking=epoch.number)
                try:
                    self._make_group(epoch, timeout_s)
                except MembershipChanged as e:
                    log.warning("epoch %d did not form (%s); trying again", epoch.number, e)
                    continue
                finally:
                    with self._lock:
                        self._announced = None
                self.set_status(state="training", epoch=epoch.number)
                return epoch
            if time.monotonic() - waited > 10:
                log.warning("replica %s waits for a quorum of %d groups (alive: %s)", self.name(self.group), min_groups,
                            sorted({g // self.procs for g in self.alive()}))
                waited = time.monotonic()
            time.sleep(self.heartbeat_s)

    def _ask(self, coordinator: int, step: int, live: bool) -> Epoch | None:
        rid = secrets.token_hex(6)
        self._write(self._senders.get(coordinator), {"t": "join", "id": rid, "step": step, "live": live,
                                                     "epoch_seen": self.max_epoch})
        deadline = time.monotonic() + 5 * self.lost_after_s + 6  # a request the coordinator passed over
        while min(self.alive()) == coordinator and time.monotonic() < deadline:
            with self._lock:
                reply = self._replies.pop(rid, None)
            if reply is not None:
                if reply["t"] != "epoch":
                    return None
                members = [Member(*m) for m in reply["members"]]
                rank = [m.group for m in members].index(self.group)
                return Epoch(reply["number"], members, rank, store=tuple(reply["store"]))
            time.sleep(0.002)
        return None

    def _coordinate(self, step: int, live: bool, min_groups: int, timeout_s: float) -> Epoch | None:
        """Wait for a join request from every group alive (a member finishing its step comes within a
        step; one that never asks is left out after a while), then announce the epoch to them."""
        started = time.monotonic()
        while True:
            alive = self.alive()
            if min(alive) != self.group:
                return None
            broken = self.broken()  # a group that lost a process leaves whole: not waited for, not let in
            if self.group in broken:  # this one's too: forming stops (Replicas.form's should_stop says why)
                return None
            with self._lock:
                asked = {g: r for g, r in self._requests.items() if alive.get(g) == r[0]["inc"]}
                starting = {g for g, s in self._seen.items() if s.get("state") == "starting"}
            if (set(alive) - {self.group} - starting - broken <= set(asked)
                    or time.monotonic() - started > 5 * self.lost_after_s + 5):
                break
            time.sleep(0.002)
        with self._lock:
            for g in asked:
                del self._requests[g]
        # whole groups only: a group's processes train together (sharded, they cannot train apart)
        here = set(asked) | {self.group}
        partial = {g for g in here if g in broken or not set(self.siblings(g)) <= here}
        waiting = list(asked) if self.group in partial else [g for g in asked if g in partial]
        for g in waiting:
            msg, conn = asked.pop(g)
            try:
                self._write(conn, {"t": "wait", "id": msg["id"]})
            except OSError:
                pass
        if self.group in partial:  # this one's own group is not all here yet: no epoch now, ask again
            return None
        members = sorted([Member(self.group, self.incarnation, step, live)]
                         + [Member(g, r[0]["inc"], r[0]["step"], r[0]["live"]) for g, r in asked.items()],
                         key=lambda m: m.group)
        if len({m.group // self.procs for m in members}) < min_groups:
            for msg, conn in asked.values():
                self._write(conn, {"t": "wait", "id": msg["id"]})
            return None
        number = max([self.max_epoch] + [r[0]["epoch_seen"] for r in asked.values()]) + 1
        host = self.peers[self.group][0]
        store = bound_store(host, 0, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        announcement = {"t": "epoch", "number": number, "store": [host, store.port],
                        "members": [[m.group, m.incarnation, m.step, m.live] for m in members]}
        with self._lock:  # a member that missed its answer (it asked again meanwhile) is answered with it
            self._announced = announcement
        for msg, conn in asked.values():
            try:
                self._write(conn, {**announcement, "id": msg["id"]})
            except OSError:
                pass  # it is lost: forming the group notices
        return Epoch(number, members, [m.group for m in members].index(self.group), store=store)

    def _make_group(self, epoch: Epoch, timeout_s: float) -> None:
        """The epoch's gloo process group, made in a thread so that a member lost meanwhile is noticed."""
        timeout = datetime.timedelta(seconds=timeout_s)
        out: dict = {}

        def make():
            try:
                store = epoch.store
                if isinstance(store, tuple):
                    store = dist.TCPStore(store[0], store[1], is_master=False, timeout=timeout)
                    out["store"] = store
                prefixed = dist.PrefixStore(derive(self.secret, f"replicas-epoch-{epoch.number}"), store)
                out["pg"] = dist.ProcessGroupGloo(prefixed, epoch.rank, epoch.world, timeout)
                if self.sharded:
                    holders = [m.group for m in epoch.holders(self.group, self.procs)]
                    shard = f"replicas-epoch-{epoch.number}-shard-{self.group % self.procs}"
                    prefixed = dist.PrefixStore(derive(self.secret, shard), store)
                    out["peers"] = dist.ProcessGroupGloo(prefixed, holders.index(self.group), len(holders), timeout)
            except Exception as e:  # noqa: BLE001 - reported to the waiting thread
                out["error"] = e

        thread = threading.Thread(target=make, daemon=True)
        thread.start()
        started = time.monotonic()
        while thread.is_alive():
            if (why := self.lost(epoch)) is not None:
                raise MembershipChanged(why)
            if time.monotonic() - started > 2 * self.lost_after_s and (late := self._not_taking(epoch)):
                raise MembershipChanged(f"{self.name(late)} did not take epoch {epoch.number}")
            thread.join(0.005)
        if "error" in out:
            raise MembershipChanged(str(out["error"]).splitlines()[0][:200])
        epoch.pg, epoch.peers = out["pg"], out.get("peers")
        if "store" in out:
            epoch.store = out["store"]

    # --- the wire ---------------------------------------------------------------------------------
    def _mac(self, nonce: str, group: int, inc: str) -> str:
        return hmac.new(self.secret, f"{nonce}|{group}|{inc}".encode(), hashlib.sha256).hexdigest()

    def _write(self, conn: socket.socket | None, msg: dict) -> None:
        if conn is None:
            raise OSError("not connected")
        with self._lock:
            lock = self._send_locks.setdefault(conn, threading.Lock())
        with lock:  # a send blocked by a cut network gives up after SO_SNDTIMEO, and holds up no other peer
            conn.sendall(json.dumps(msg).encode() + b"\n")

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One peer's heartbeats and requests; the first line must prove the job secret."""
        group = inc = None
        try:
            nonce = secrets.token_hex(16)
            conn.settimeout(5.0)
            conn.sendall(json.dumps({"nonce": nonce}).encode() + b"\n")
            reader = conn.makefile("rb")
            hello = json.loads(reader.readline(4096) or b"{}")
            group, inc = hello.get("group"), hello.get("inc")
            if not (isinstance(group, int) and 0 <= group < len(self.peers) and group != self.group
                    and isinstance(inc, str)
                    and hmac.compare_digest(str(hello.get("mac", "")), self._mac(nonce, group, inc))):
                log.warning("replica beacon: refused a connection that did not prove the job secret")
                return
            if hello.get("members") != len(self.peers):  # its member numbers are not ours: it must not join
                if not self._told_size:
                    self._told_size = True
                    log.error("replica beacon: refused a peer of this job that counts %s processes in all, where this "
                              "one counts %d: start every group with the same --nproc_per_node and replicas.peers",
                              hello.get("members"), len(self.peers))
                return
            conn.settimeout(None)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
            for line in reader:
                msg = json.loads(line)
                with self._lock:
                    if msg.get("t") == "hb":
                        self._seen[group] = {**msg, "inc": inc, "t": time.monotonic(), "eof": False}
                        self.max_epoch = max(self.max_epoch, int(msg.get("epoch", -1)))
                    elif msg.get("t") == "join":
                        news = self._announced
                        if news and [group, inc] in [m[:2] for m in news["members"]]:
                            self._requests.pop(group, None)
                        else:
                            news = None
                            self._requests[group] = ({**msg, "inc": inc}, conn)
                if msg.get("t") == "join" and news:  # it missed the answer to an earlier request
                    self._write(conn, {**news, "id": msg["id"]})
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                if group is not None and self._seen.get(group, {}).get("inc") == inc:
                    self._seen[group]["eof"] = True
            conn.close()

    def _send(self, group: int) -> None:
        """Keep a connection to `group`'s beacon: heartbeats out, replies to our requests in."""
        while not self._stop.is_set():
            conn = None
            try:
                conn = socket.create_connection(self.peers[group], timeout=max(self.lost_after_s, 0.5))
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reader = conn.makefile("rb")
                nonce = json.loads(reader.readline(4096))["nonce"]
                conn.sendall(json.dumps({"group": self.group, "inc": self.incarnation, "members": len(self.peers),
                                         "mac": self._mac(nonce, self.group, self.incarnation)}).encode() + b"\n")
                conn.settimeout(None)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
                self._senders[group] = conn
                threading.Thread(target=self._read_replies, args=(reader,), daemon=True).start()
                while not self._stop.is_set():
                    with self._lock:
                        status = dict(self.status)
                    self._write(conn, {"t": "hb", **status})
                    time.sleep(self.heartbeat_s)
            except (OSError, ValueError, KeyError):
                self._senders.pop(group, None)
                if conn is not None:
                    conn.close()  # its reader thread ends with it
                time.sleep(self.heartbeat_s)

    def _read_replies(self, reader) -> None:
        try:
            for line in reader:
                msg = json.loads(line)
                with self._lock:
                    self._replies[str(msg.get("id"))] = msg
        except (OSError, ValueError):
            pass
