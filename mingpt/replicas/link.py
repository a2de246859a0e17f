"""A replica member's links: a TLS server on its own address (the channels of the members that dial
this one) and channels out to a few members (`Links.targets`), each carrying heartbeats both ways,
join requests and their replies. Sockets, threads, the handshake and the hello live here, with their
own table of connections; what the records mean is their owner's (the Beacon,
mingpt/replicas/beacon.py), told through callbacks."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import logging
import random
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from mingpt.replicas.wire import (
    HANDSHAKE_S,
    PROTOCOL,
    Bye,
    Channel,
    Down,
    Heartbeat,
    Hello,
    Reactor,
    Up,
    WireError,
    bounded,
    contexts,
    encode,
    parse,
    read_line,
)

log = logging.getLogger("mingpt.replicas.beacon")

PROBES = 4  # dials at once to members not pinned (the lowest members, or those below them that may be back)
HANDSHAKES = 16  # connections in their handshake at once (each sent its first bytes): more are closed unread
SILENT = 256  # connections accepted that have sent nothing yet: beyond this, the oldest is closed


class ReplicaError(RuntimeError):
    """Replica groups cannot work as configured; the message says what to change."""


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ReplicaError(f"replicas.peers entry {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def port_holder(port: int) -> str:
    """", held by USER (uid N)" for the user whose socket listens on `port` (from /proc/net), or ""."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = [line.split() for line in fh.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > 7 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                uid = int(row[7])
                try:
                    import pwd
                    user = pwd.getpwuid(uid).pw_name
                except (KeyError, ImportError):
                    user = "?"
                return f", held by {user} (uid {uid})"
    return ""


def member_addresses(groups: list[str], procs: int) -> list[str]:
    """Every member's beacon address, from each group's (replicas.peers): process i of a group listens on
    its group's port + i."""
    out = []
    for address in groups:
        host, port = host_port(address)
        out += [f"[{host}]:{port + i}" if ":" in host else f"{host}:{port + i}" for i in range(procs)]
    if len(set(out)) != len(out):
        raise ReplicaError(f"with {procs} processes per group, group g's processes listen on its replicas.peers "
                           f"port and the {procs - 1} after it: these overlap in {groups}; space the ports at "
                           f"least {procs} apart")
    return out


class Links:
    """The sockets of member `me` of `addresses` (every member's (host, port), `procs` per group): a server
    for the others' channels in, and channels out to a few members only (never to every one): the two
    lowest-numbered members up (the coordinator and its successor, who so hear every member), those the
    owner pins (`pins()`: its epoch's coordinator and successor, its own group's processes), and probes
    of any member below the second of those (a member come back). So a member holds a constant number
    of channels whatever the job's size; the coordinator and its successor hold one per member.

    Each channel carries the owner's `heartbeat()` both ways, every heartbeat_s, so either end hears the
    other alive. The process's reactor (wire.py: one thread for every channel of every beacon in the
    process) reads and writes the channels once their handshake is done, and runs the ticks; a
    handshake, in or out, has a thread of its own until it ends. Lines are parsed here; their records go
    to the owner's `on_message(member, inc, msg, channel)` (`channel` to answer on; on the reactor once
    `start`ed: it must not block, as every channel of the process waits for it; one that returns a
    string drops the record, saying why); `on_up(member)` a channel is up (either way);
    `on_lost(member, inc)` a member's connection ended without its goodbye (under the links' lock: it
    must not call Links but `wake`).

    A job of more than `fan_out` + 1 members is a tree instead (`tree`): a member keeps one channel up,
    to its parent (member (n - 1) // fan_out, else the nearest ancestor up, else its place in the same
    tree of the members past the lowest ones down: `candidates`), and its children dial it. What a
    member hears of the others comes relayed: heartbeats, join requests and lost connections go up, from
    relay to relay, to the root (which hears every member, as the coordinator must); the root's
    heartbeats, its answers and its announcements come down, each line passed on as it came. So every
    member holds at most fan_out + 1 channels (its group's aside)."""

    def __init__(self, addresses: list[tuple[str, int]], me: int, incarnation: str, secret: bytes, heartbeat_s: float,
                 lost_after_s: float, procs: int, *, heartbeat: Callable[[], Heartbeat], on_message: Callable,
                 on_up: Callable[[int], None], on_lost: Callable[[int, str], None],
                 pins: Callable[[], set[int]] = set, fan_out: int = 0):
        self.addresses, self.member, self.incarnation, self.procs = addresses, me, incarnation, procs
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self.heartbeat, self.on_message, self.on_up, self.on_lost, self.pins = heartbeat, on_message, on_up, on_lost, pins
        self.dropped: Counter = Counter()  # messages and connections dropped, by sender
        self.sent: Counter = Counter()  # messages and bytes this member sent (heartbeats, requests, replies)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._tls_server, self._tls_client = contexts(secret)
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        self._door = threading.Lock()
        self._shaking: dict = {}  # connections in their handshake -> (deadline, address), oldest first
        self._inbound: dict[int, Channel] = {}  # each member's newest authenticated connection to this server
        self._senders: dict[int, Channel] = {}  # channels out, by member
        self._dialing: set[int] = set()  # members a thread is dialling now
        self._retry: dict[int, float] = {}  # member -> when a failed dial may be tried again
        self._failures: Counter = Counter()  # member -> failed dials in a row (the wait grows with them)
        self._tick_at: float | None = None  # when the reactor ticks next (`_tick_in`)
        self._tick_lock = threading.Lock()
        self._woken = False  # (under _tick_lock) the next tick beats, whether due or not
        self._beat_due, self._last_beat, self._last_line = 0.0, None, b""  # when the next heartbeat is due; the last
        # one sent, and its line
        self._stop = threading.Event()
        self._told_size = False  # a peer of another size of job was named once (it dials again and again)
        self.fan_out = fan_out
        self.tree = 0 < fan_out < len(addresses) - 1
        self._parent: int | None = None  # (a tree) the member this one hangs from now; None: it is the root, or looks
        self._settled = False  # (a tree) it has hung from a parent
        self._root: tuple[int, str] | None = None  # (a tree) the root whose heartbeats came down last: (member, inc)
        self._up_beats: dict[int, tuple] = {}  # (a tree) the newest heartbeat of each member below, to pass up
        self._up_more: dict[tuple, tuple] = {}  # (a tree) each member's newest join request and lost connection to
        # pass up, oldest first (a relay with no parent for a while holds two a member at most)
        self._up_last: dict[int, tuple] = {}  # the last heartbeat passed up of each member below: (inc, beat), on
        self._up_to: Channel | None = None  # this channel to the parent (a new parent hears every one in full)
        self._down_more: list[tuple] = []  # (a tree) answers to send down: the root's, and those passing through
        self._routes: dict[int, int] = {}  # (a tree) member below -> the member below this one it came up through
        self._down: set[int] = set()  # members whose last dial found nobody there (refused, or no answer in time): a
        # member busy with other handshakes closes a dial, and is not down

    def start(self) -> None:
        # the ticks first: while the port is taken, the other members hear this one (starting), and
        # wait for it rather than end the job for want of a group
        self.wake()
        try:
            self._server = self._listen()
        except BaseException:
            self._stop.set()
            raise
        # made here, not in the thread: a thread that starts late (a loaded node) may find no descriptor left
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        threading.Thread(target=self._accept, args=(selector,), daemon=True).start()

    def targets(self) -> tuple[set[int], set[int]]:
        """(members to keep a channel to, members to dial now): the two lowest members up (in a tree: the
        first member up of `candidates`, its parent), the pinned, and a dial to every member before
        them whose last dial did not fail just now (at most PROBES at once beyond the pinned: a job
        starting all at once does not dial every member)."""
        now = time.monotonic()
        with self._lock:
            up, dialing = set(self._senders), set(self._dialing)
        pins = {m for m in self.pins() if 0 <= m < len(self.addresses) and m != self.member}
        keep, dial, found = set(pins), {m for m in pins - up - dialing if self._retry.get(m, 0) <= now}, 0
        probes = len(dialing - pins)
        parent = None
        if self.tree and (silent := self._silent_parent(now)) is not None:
            up.discard(silent)
        candidates = self.candidates()
        for m in candidates:
            if m == self.member:
                continue
            if m in up:
                keep.add(m)
                found += 1
                if self.tree:
                    parent = m
                if found == (1 if self.tree else 2):
                    break
            elif self.tree:  # one dial up at a time: a thousand members starting at once each dialled four
                # ancestors, the root among them; and a member that has never had a parent waits lost_after_s for
                # its own to start before it dials the next one up
                if m in self._down and (self._settled or now - self.started >= self.lost_after_s):
                    if m in dialing:  # (a look whether it is back: the members after it go on meanwhile)
                        keep.add(m)
                    elif self._retry.get(m, 0) <= now and probes < PROBES:
                        dial.add(m)
                        probes += 1
                    continue
                if m in dialing:
                    keep.add(m)
                elif self._retry.get(m, 0) <= now:
                    dial.add(m)
                break
            elif m in dialing:
                keep.add(m)
            elif self._retry.get(m, 0) <= now and probes < PROBES:
                dial.add(m)
                probes += 1
        if self.tree and parent is None:  # (while it dials a nearer one, it keeps the one it hangs from)
            parent = next((m for m in candidates if m in up), None)
            keep |= {parent} - {None}
        self._parent = parent
        self._settled = self._settled or parent is not None
        return keep, dial

    def _silent_parent(self, now: float) -> int | None:
        """(A tree) the parent, if nothing came from it for 4 x lost_after_s (as long as a member may be late):
        a frozen process, a cut network, a channel that does not close. Its channel is closed, and it is down
        until a dial finds it again."""
        with self._lock:
            channel = self._senders.get(self._parent) if self._parent is not None else None
            if channel is None or now - channel.heard < 4 * self.lost_after_s:
                return None
            self._down.add(self._parent)
            self._failures[self._parent] += 1
            self._retry[self._parent] = now + self.lost_after_s
        channel.close()
        return self._parent

    def candidates(self):
        """The members this one looks for a channel to, in order: every member by number (the two lowest up
        hear all); in a tree its ancestors (parent first), and where every one of them is down, its
        ancestors in the same tree of the members past the lowest ones found down (the lowest of those
        is its root): a few members, whatever the job's size. A member hanging from none (the root) also
        looks at every member below it, all down, now and then: one of them back is the root."""
        if not self.tree:
            return range(len(self.addresses))
        with self._lock:  # the lowest members, found down here, or by the root heard (the lowest member up)
            lost = max(next(m for m in itertools.count() if m not in self._down), self._root[0] if self._root else 0)
            lost = min(lost, self.member)
            chain = self.ancestors(self.member)
            if all(m in self._down for m in chain):
                chain += [m + lost for m in self.ancestors(self.member - lost)]
            if self._parent is None:
                chain += [m for m in range(self.member) if m not in chain]
        return chain

    def ancestors(self, member: int) -> list[int]:
        """(A tree) `member`'s parent, its parent's parent, and so on to member 0."""
        chain = []
        while member > 0:
            member = (member - 1) // self.fan_out
            chain.append(member)
        return chain

    @property
    def parent(self) -> int | None:
        """(A tree) the member this one hangs from now (None: none, the root)."""
        return self._parent

    def is_root(self) -> bool:
        """Whether this member hears every other (the coordinator must): always, but in a tree, where it
        has no parent and every member below it failed its last dial (it is the lowest member up)."""
        if not self.tree:
            return True
        with self._lock:
            return self._parent is None and all(m in self._down for m in range(self.member))

    def _pinned(self) -> set[int]:
        first = self.member - self.member % self.procs
        return set(range(first, first + self.procs))

    def broadcast(self, msg) -> None:
        """(The root of a tree) `msg` to every member, down the tree."""
        self._flood(encode(Down(((self.member, self.incarnation, -1, msg),))))

    def _flood(self, line: bytes) -> None:
        """A line to every member below this one: the channels in, but its group's."""
        with self._lock:
            below = [c for m, c in self._inbound.items() if m not in self._pinned()]
        for channel in below:
            with contextlib.suppress(OSError):
                channel.send(line)

    def _send_down(self, items: list[tuple]) -> None:
        """Records down: one for every member to every member below, one for a member on its way to it only
        (the member below this one it came up through)."""
        with self._lock:
            below = {m: c for m, c in self._inbound.items() if m not in self._pinned()}
            lines: dict[int, list] = {}
            for item in items:
                for m in (below if item[2] == -1 else [self._routes.get(item[2], item[2])]):
                    lines.setdefault(m, []).append(item)
        for m, mine in lines.items():
            if m in below:
                for line in bounded(Down, mine):
                    with contextlib.suppress(OSError):
                        below[m].send(line)

    def _pass_up(self, member: int, inc: str, msg, via: int | None = None) -> None:
        """(A tree, under the lock) a record of a member below, to pass up (a heartbeat replaces the last one
        not yet passed, and waits for the next tick unless it says something new)."""
        if via is not None:
            self._routes[member] = via
        if isinstance(msg, Heartbeat):
            self._up_beats[member] = (member, inc, msg)
            if self._up_last.get(member) == (inc, msg):
                return
        else:
            key = (member, type(msg))
            self._up_more.pop(key, None)
            self._up_more[key] = (member, inc, msg)
        self._tick_in(0.0)  # (a relay's turn now)

    def _from_below(self, member: int, msg, channel: Channel) -> str | None:
        """(A tree) the records an Up from `member`, a member below, passes on: delivered here if this is
        the root, else passed up. Its members that say the same are their heartbeats this channel carried
        last, again."""
        root = self.is_root()
        for m, inc, record in msg.items:
            if isinstance(record, Heartbeat):
                channel.beats[m] = (inc, record)
        same = [(m, *channel.beats[m]) for m in msg.same if m in channel.beats]
        for m, inc, record in (*msg.items, *same):
            if m == self.member:
                continue  # (its own, come back round a loop that a moment's change of parents made)
            if not root:
                with self._lock:
                    self._pass_up(m, inc, record, member)
            elif record is None:
                with self._lock:
                    self.on_lost(m, inc)
            else:
                with self._lock:
                    self._routes[m] = member
                if (why := self.on_message(m, inc, record, _Route(self, m))) is not None:
                    self.drop(self.name(member), why)
        return None

    def _from_above(self, member: int, msg, line: bytes) -> str | None:
        """(A tree) a Down from `member`: passed on first (the line as it came, if it is for every member: an
        announcement of a thousand members is not encoded again; else each record towards its member), then
        its records for this member (or every one) delivered. From a member that is not this one's parent
        (one of a moment ago, or a member it dialled to look), dropped."""
        if member != self._parent:
            return None
        if all(to in (-1, self.member) for _, _, to, _ in msg.items):
            self._flood(line + b"\n")
        else:
            with self._lock:
                self._down_more += [i for i in msg.items if i[2] != self.member]
            self._tick_in(0.0)
        for m, inc, to, record in msg.items:
            if to not in (-1, self.member) or m == self.member:
                continue
            if record is None:
                with self._lock:
                    self.on_lost(m, inc)
                continue
            if to == -1 and isinstance(record, Heartbeat) and self._root != (m, inc):
                # a new root: it dialled every member below it and found none (a higher one), or is the old one's
                # new process; the old root is lost (the members that heard it go no further than a root's child)
                if self._root is not None and m >= self._root[0]:
                    with self._lock:
                        self.on_lost(*self._root)
                self._root = (m, inc)
            if (why := self.on_message(m, inc, record, None)) is not None:
                self.drop(self.name(member), why)
        return None

    def name(self, member: int) -> str:
        """A member as the logs name it: "group 2", or "group 2 process 1" with several per group."""
        return f"group {member}" if self.procs == 1 else f"group {member // self.procs} process {member % self.procs}"

    def send(self, member: int, msg) -> None:
        """`msg` to `member` over a channel to it (this member's, else the member's), else OSError; in a tree,
        up the tree to the root, whoever it is now (a member that has just lost its root may not know the
        next one yet: it asked its parent, which is not the root, and was told to wait). A channel being
        closed (a goodbye) is no channel: what is sent on it after its last flush is lost."""
        if self.tree and self._parent is not None:
            with self._lock:
                return self._pass_up(self.member, self.incarnation, msg)
        for channel in (self._senders.get(member), self._inbound.get(member)):
            if channel is not None and not channel.bye:
                return channel.send(msg)
        raise OSError("not connected")

    def _listen(self) -> socket.socket:
        """A listener on this member's address only (nothing listens wider than it must). A port held
        by another process (a previous incarnation's lingering socket, or another user) is tried again
        for as long as this process runs: every 10 s at most, the holder named where /proc tells it, in
        a line a minute at most once it has been said."""
        host, port = self.addresses[self.member]
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        pause, said = 0.5, -1e9
        while True:
            server = socket.socket(family, kind, proto)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(address)
                server.listen(64)
                return server
            except OSError as e:
                server.close()
                if e.errno != errno.EADDRINUSE:
                    raise ReplicaError(f"replica {self.name(self.member)} cannot listen on {host}:{port} ({e.strerror}"
                                       f"{port_holder(port)}): give replicas.peers an address of this host with a free "
                                       "port" + (f" (and the {self.procs - 1} after it)" if self.procs > 1 else "")) from None
                if time.monotonic() - said >= 60:
                    said = time.monotonic()
                    log.warning("replica %s cannot listen on %s:%d yet (%s%s); trying again every %.0f s at most",
                                self.name(self.member), host, port, e.strerror, port_holder(port), 10.0)
                time.sleep(pause)
                pause = min(2 * pause, 10.0)

    def channels(self) -> int:
        """Connections this member holds now: channels out, and authenticated connections in."""
        with self._lock:
            return len(self._senders) + len(self._inbound)

    def close(self) -> None:
        log.info("replica beacon of %s: %d channels at the end; sent %d messages (%d bytes) in %.1f s",
                 self.name(self.member), self.channels(), self.sent["messages"], self.sent["bytes"],
                 time.monotonic() - self.started)
        self._stop.set()
        self.wake()
        with self._lock:
            channels = [*self._senders.values(), *self._inbound.values()]
        for s in [getattr(self, "_server", None), *channels]:
            if s is None:
                continue
            try:
                s.close()
            except OSError:
                pass

    def drop(self, who: str, why: str) -> None:
        """A message that is not one of ours, or a connection that did not prove the secret: dropped,
        counted, and logged the first time for each sender."""
        with self._lock:
            self.dropped[who] += 1
            first = self.dropped[who] == 1
        if first:
            log.warning("replica beacon: dropped %s from %s (logged once; `dropped` counts them)", why, who)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        """Accept connections. One that has sent nothing costs a descriptor only (the oldest make room for
        new ones beyond SILENT); its handshake gets a thread once its first bytes arrive (HANDSHAKES at
        once); each has HANDSHAKE_S from its accept to its hello. So silent connections cannot hold the
        door: a member's handshake starts the moment its first bytes arrive."""
        silent: dict[socket.socket, tuple[float, object]] = {}  # -> (deadline, address), oldest first
        while not self._stop.is_set():
            now = time.monotonic()
            while silent and next(iter(silent.values()))[0] <= now:
                self._close_silent(selector, silent, next(iter(silent)), "a connection that sent nothing")
            with self._door:
                while self._shaking and next(iter(self._shaking.values()))[0] <= now:
                    tls, _ = next(iter(self._shaking.items()))
                    del self._shaking[tls]
                    with contextlib.suppress(OSError):  # its thread fails at once, and closes it
                        socket.socket.shutdown(tls, socket.SHUT_RDWR)
                deadlines = [next(iter(d.values()))[0] for d in (silent, self._shaking) if d]
            try:
                ready = selector.select(min([1.0, *(d - now for d in deadlines)]))
            except (OSError, ValueError):  # the listener closed
                return
            for key, _ in ready:
                if key.fileobj is self._server:
                    self._take(selector, silent)
                elif key.fileobj in silent:  # its first bytes (or its end): the handshake starts
                    conn = key.fileobj
                    selector.unregister(conn)
                    deadline, address = silent.pop(conn)
                    if not self._handshakes.acquire(blocking=False):
                        conn.close()
                        self.drop("the accept loop", f"a connection beyond {HANDSHAKES} in their handshake")
                        continue
                    threading.Thread(target=self._serve, args=(conn, address, deadline), daemon=True).start()
        for conn in silent:
            conn.close()
        selector.close()

    def _take(self, selector, silent: dict) -> None:
        """A connection from the listener, to wait for its first bytes."""
        try:
            conn, address = self._server.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self.drop("the accept loop", f"a connection ({e.strerror}: out of descriptors)")
                time.sleep(0.05)  # connections close meanwhile; the listener stays
            return
        # (small lines, each wanted at once: without it, the server's hello and its first heartbeat, written
        # one after the other, waited for the client's delayed ACK, and a member back was heard 0.2 s late)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(silent) >= SILENT:
            self._close_silent(selector, silent, next(iter(silent)), f"the oldest of {SILENT} silent connections")
        silent[conn] = (time.monotonic() + HANDSHAKE_S, address)
        selector.register(conn, selectors.EVENT_READ)

    def _close_silent(self, selector, silent: dict, conn: socket.socket, what: str) -> None:
        selector.unregister(conn)
        _, address = silent.pop(conn)
        conn.close()
        self.drop(str(address[0]), f"{what} (it did not prove the job secret in {HANDSHAKE_S:g} s)")

    def _serve(self, conn: socket.socket, address, deadline: float) -> None:
        """One peer's handshake and hello (by `deadline`, from its accept: the accept loop shuts it down
        then); its channel then goes to the reactor, with its heartbeats and requests."""
        tls = None
        try:
            tls = self._tls_server.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            with self._door:
                self._shaking[tls] = (deadline, address)
            tls.settimeout(max(0.01, deadline - time.monotonic()))
            tls.do_handshake()
            tls.settimeout(max(0.01, deadline - time.monotonic()))
            hello = parse(read_line(tls), len(self.addresses))
        except (OSError, WireError, ValueError) as e:  # ValueError: shut down by the accept loop meanwhile
            (tls or conn).close()
            self.drop(str(address[0]), f"a connection that did not prove the job secret ({e})")
            return
        finally:
            with self._door:
                self._shaking.pop(tls, None)
            self._handshakes.release()
        if not self._welcome(hello, tls):
            tls.close()
            return
        member, inc = hello.member, hello.inc
        try:  # the hello in a record of its own, before the channel has any line to send: one after it fails the dial
            tls.settimeout(max(0.01, deadline - time.monotonic()))
            tls.sendall(encode(Hello(PROTOCOL, self.member, self.incarnation, len(self.addresses), member)))
        except OSError:
            tls.close()
            return
        channel = Channel(tls, lambda line: self._deliver(channel, line, member, "a message",
                                                           lambda msg: self._take_in(member, inc, msg, channel)),
                          sent=self.sent)
        with self._lock:  # this connection is now the member's: an older one's end says nothing of it
            if self._stop.is_set():  # (closed meanwhile)
                channel.close()
                return
            self._inbound[member] = channel
            self._retry.pop(member, None)  # it is up: a dial to it (where this member wants one) goes now
            self._failures.pop(member, None)
        self.wake()
        with contextlib.suppress(OSError):  # (closed meanwhile: it ends at once)
            channel.send(self.heartbeat())
        self.on_up(member)
        channel.start(lambda: self._ended_in(member, inc, channel))

    def _ended_in(self, member: int, inc: str, channel: Channel) -> None:
        """A channel in ended: only the member's newest connection says, by ending without a goodbye, that it is gone."""
        with self._lock:
            if self._inbound.get(member) is channel:
                del self._inbound[member]
                if not channel.bye:
                    self.on_lost(member, inc)
                    if self.tree and self._parent is not None:
                        self._pass_up(member, inc, None)

    def _take_in(self, member: int, inc: str, msg, channel: Channel) -> str | None:
        if isinstance(msg, Bye):  # it no longer needs this channel: its end says nothing of it
            channel.bye = True
            return None
        if isinstance(msg, Down):
            return "a Down from a member below"
        if self.tree and member not in self._pinned():
            if isinstance(msg, Up):
                return self._from_below(member, msg, channel)
            if isinstance(msg, Heartbeat) and not self.is_root():
                with self._lock:
                    self._pass_up(member, inc, msg)
        elif isinstance(msg, Up):
            return "an Up outside a tree"
        return self.on_message(member, inc, msg, channel)

    def _take_out(self, member: int, inc: str, msg, channel: Channel, line: bytes) -> str | None:
        if isinstance(msg, Up):
            return "an Up from a member this one dialled"
        if isinstance(msg, Down):
            return self._from_above(member, msg, line) if self.tree else "a Down outside a tree"
        return self.on_message(member, inc, msg, channel)

    def _deliver(self, channel: Channel, line: bytes, member: int, what: str,
                 handler: Callable[[object], str | None]) -> None:
        """A line from `member` into its record, for `handler`; dropped if not one of ours, or if `handler`
        says why. A line the same as the channel's last is its record again, not parsed (most are: a
        member's beats say the same until its state changes, and the root's come down unchanged)."""
        if line == channel.last[0]:
            msg = channel.last[1]
        else:
            try:
                msg = parse(line, len(self.addresses))
            except WireError as e:
                return self.drop(self.name(member), f"{what} that is not one of ours ({e})")
            channel.last = (line, msg)
        if (why := handler(msg)) is not None:
            self.drop(self.name(member), why)

    def _welcome(self, hello, tls) -> bool:
        """Whether a peer's hello (it holds the secret) is of this job's protocol and layout."""
        if not isinstance(hello, Hello) or hello.v != PROTOCOL:
            self.drop("a peer", f"a hello of another protocol ({hello})")
            return False
        if hello.members != len(self.addresses):  # its member numbers are not ours: it must not join
            if not self._told_size:
                self._told_size = True
                log.error("replica beacon: refused a peer of this job that counts %s processes in all, where this "
                          "one counts %d: start every group with the same --nproc_per_node and replicas.peers",
                          hello.members, len(self.addresses))
            return False
        if not 0 <= hello.member < len(self.addresses) or hello.member == self.member:
            self.drop("a peer", f"a hello from member {hello.member}")
            return False
        if hello.to != self.member:  # it dialled another member's address, and was relayed here
            self.drop(f"{self.name(hello.member)} relayed", f"a hello for {self.name(hello.to)} (a relay)")
            return False
        tls.settimeout(None)
        return True

    def _tick(self) -> None:
        """(On the reactor) a beat every heartbeat_s, and at once when woken (`wake`); a relay's turn between
        (what waits to go up, within half a heartbeat): only that (a beat's work on each relay's turn, 20 a
        second, was most of a relay's)."""
        with self._tick_lock:
            self._tick_at, woken, self._woken = None, self._woken, False
        if self._stop.is_set():
            return
        early = time.monotonic() < self._beat_due  # (woken, or a relay's turn: the beat itself waits for its time)
        if woken or not early:
            self._beat(early)
        if self.tree:
            self._relay()
        wait = self._beat_due - time.monotonic()
        if self._up_beats:  # (a relay passes its members' heartbeats up within half a heartbeat)
            wait = min(wait, self.heartbeat_s / 2)
        self._tick_in(max(0.0, wait))

    def _beat(self, early: bool) -> None:
        """Channels out opened and closed as `targets` says, and the owner's heartbeat sent on every channel,
        out and in, if it is due or says something new."""
        keep, dial = self.targets()
        if self.tree and self._root is not None and self._root[0] < self.member and self.is_root():
            # this member found every member below it down: the root it heard of is lost (whatever its
            # last heartbeats said), and the members below this one hear that with its own beats
            with self._lock:
                self.on_lost(*self._root)
            # (with this member's beat: the members below hear of the next root at once, and ask it)
            self._flood(encode(Down((self._root + (-1, None), (self.member, self.incarnation, -1,
                                                                  self.heartbeat())))))
            self._root = None
        for m in dial:
            with self._lock:
                self._dialing.add(m)
            threading.Thread(target=self._dial_to, args=(m,), daemon=True).start()
        root = self.tree and self.is_root()
        with self._lock:
            out = dict(self._senders)
            # (in a tree, its children hear the root's beats through it, which keep their channels up: its own
            # beats to them, which none of them reads, were a third of a tree's lines; they go where the root's
            # have not for two beats, so that a child hears its parent alive whatever the members above do)
            now, pinned = time.monotonic(), self._pinned()
            quiet = now - 2 * max(self.heartbeat_s, self.lost_after_s / 4)
            channels = list(out.values()) + [c for m, c in self._inbound.items() if not self.tree or m in pinned
                                             or (not root and c.said <= quiet)]
        for m, channel in out.items():
            if m not in keep:  # not needed: said goodbye to, so its end is no loss there
                with contextlib.suppress(OSError):
                    channel.send(Bye())
                channel.bye = True
                channel.close_after_flush()
        beat, last = self.heartbeat(), self._last_beat
        # what changed goes at once (woken early), but for the count of groups alive, which goes with the next
        # beat (at 1,024 members, each member heard late or back again sent the root's beat down to all);
        # with nothing new, a beat every heartbeat_s, or a quarter of lost_after_s if longer: enough to be heard
        # alive, and a coordinator of 32 groups on a sixteenth of a core spent all of it on 620 beats a second
        if not early or (beat != last and (last is None or dataclasses.replace(beat, groups=last.groups) != last)):
            if beat != self._last_beat:  # (encoded once for all, and again only when it changes)
                self._last_beat, self._last_line = beat, encode(beat)
            line = self._last_line
            self._beat_due = time.monotonic() + max(self.heartbeat_s, self.lost_after_s / 4)
            for channel in channels:
                with contextlib.suppress(OSError):
                    channel.send(line)
            if root:  # (the members below hear the root's beats, passed down)
                self._flood(encode(Down(((self.member, self.incarnation, -1, beat),))))

    def _tick_in(self, delay: float) -> None:
        """The next tick within `delay` seconds (on the reactor; one a member is waiting at a time)."""
        when = time.monotonic() + delay
        with self._tick_lock:  # (not the links' lock: on_lost, under it, wakes the ticks)
            if self._stop.is_set() or (self._tick_at is not None and self._tick_at <= when):
                return
            self._tick_at = when
        Reactor.get().call_at(when, lambda: self._tick() if self._tick_at == when else None)

    def _relay(self) -> None:
        """(A tree) what waits to go up, to the parent, in one line; the root's answers, down in one line."""
        with self._lock:
            down, self._down_more = self._down_more, []
            parent = self._senders.get(self._parent) if self._parent is not None else None
            items, same = [], []
            if parent is not None and (self._up_beats or self._up_more):
                if parent is not self._up_to:  # (a new parent: it has heard none of them)
                    self._up_to, self._up_last = parent, {}
                for m, inc, beat in self._up_beats.values():  # (an unchanged one as its number only: the members'
                    # records, read and written again by every relay up, were most of a relay's time)
                    if self._up_last.get(m) == (inc, beat):
                        same.append(m)
                    else:
                        items.append((m, inc, beat))
                        self._up_last[m] = (inc, beat)
                items += self._up_more.values()
                self._up_beats, self._up_more = {}, {}
        if down:
            self._send_down(down)
        per = min(500, len(self.addresses))  # (within an Up's bound)
        lines = [line for first in range(0, len(items), per) for line in bounded(Up, items[first:first + per])]
        for line in lines + ([encode(Up((), tuple(same)))] if same else []):
            with contextlib.suppress(OSError):
                parent.send(line)

    def hurry(self, members) -> None:
        """Dial `members` now, not after their failed dials' wait (one of them may be back)."""
        with self._lock:
            for m in members:
                self._retry.pop(m, None)
        self.wake()

    def wake(self) -> None:
        """A beat now: heartbeats out (the owner's news: the others hear it within a message, not a heartbeat
        later), channels opened and closed (a member dialled in, a channel ended)."""
        with self._tick_lock:
            self._woken = True
        self._tick_in(0.0)

    def _dial_to(self, member: int) -> None:
        """A channel to `member`'s beacon (its handshake and hello here; then the reactor's), for as long as
        it is up and wanted: heartbeats both ways, requests out and replies in."""
        tls = None
        try:
            try:
                conn = socket.create_connection(self.addresses[member], timeout=max(self.lost_after_s, HANDSHAKE_S))
            except OSError:
                with self._lock:
                    self._down.add(member)
                raise
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = conn  # (closed below if the handshake fails)
            tls = self._tls_client.wrap_socket(conn)
            tls.sendall(encode(Hello(PROTOCOL, self.member, self.incarnation, len(self.addresses), member)))
            hello = parse(read_line(tls), len(self.addresses))
            if (not isinstance(hello, Hello) or hello.member != member or hello.to != self.member
                    or hello.v != PROTOCOL):
                # a relay: whoever holds the address we dialled passed us on to another member
                self.drop(f"{self.name(member)}'s address", f"a server that is not {self.name(member)} ({hello})")
                raise WireError("not the member dialled")
        except (OSError, WireError):
            if tls is not None:
                tls.close()
            with self._lock:
                self._dialing.discard(member)
                # not reached: dialled again after 2 heartbeats, twice that after another failure, up to
                # lost_after_s, each spread by chance: a job of hundreds starting at once does not dial its
                # coordinator (16 handshakes at once, the rest closed) in lockstep
                self._failures[member] += 1
                wait = min(self.lost_after_s, 2 * self.heartbeat_s * 2 ** min(self._failures[member] - 1, 8))
                self._retry[member] = time.monotonic() + wait * random.uniform(0.5, 1.5)
            # a failed probe's place goes to a probe of the next member down the list (a probe a tick: after a
            # rack of the lowest members was SIGKILLed, survivors took a second or more to dial the new
            # coordinator, and some missed its first epoch)
            self.wake()
            return
        inc = hello.inc
        channel = Channel(tls, lambda line: self._deliver(channel, line, member, "a reply",
                                                          lambda msg: self._take_out(member, inc, msg, channel, line)),
                          sent=self.sent)
        with self._lock:
            self._senders[member] = channel
            self._dialing.discard(member)
            self._down.discard(member)
            self._failures.pop(member, None)
        with contextlib.suppress(OSError):  # (closed meanwhile: it ends at once)
            channel.send(self.heartbeat())
        self.on_up(member)
        channel.start(lambda: self._ended_out(member, inc, channel))

    def _ended_out(self, member: int, inc: str, channel: Channel) -> None:
        """A channel out ended: its member is lost, unless we said goodbye; its place among the lowest members
        up goes to the next one now."""
        lost_root = False
        with self._lock:
            if self._senders.get(member) is channel:
                del self._senders[member]
                if not channel.bye:
                    self.on_lost(member, inc)
                    self._down.add(member)
                    lost_root = self.tree and self._root == (member, inc)
        if lost_root:  # the members below heard it through this one: they hear it lost
            self._flood(encode(Down(((member, inc, -1, None),))))
        self.wake()


class _Route:
    """(The root of a tree) a member below, to answer as if over a channel to it: the answer goes down."""

    def __init__(self, links: Links, member: int):
        self.links, self.member = links, member

    def send(self, msg) -> None:
        with self.links._lock:
            self.links._down_more.append((self.links.member, self.links.incarnation, self.member, msg))
        self.links._tick_in(0.0)  # (a relay's turn: down now)
