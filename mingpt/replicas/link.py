"""A replica member's links: a TLS server on its own address (the channels of the members that dial
this one) and channels out to a few members (`Links.targets`), each carrying heartbeats both ways,
join requests and their replies. Sockets, threads, the handshake and the hello live here, with their
own table of connections; what the records mean is their owner's (the Beacon,
mingpt/replicas/beacon.py), told through callbacks."""

from __future__ import annotations

import contextlib
import errno
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
    Heartbeat,
    Hello,
    WireError,
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

    Each channel carries the owner's `heartbeat()` both ways, every heartbeat_s (one thread ticks them
    all), so either end hears the other alive. Lines are parsed here; their records go to the owner's
    `on_message(member, inc, msg, channel)` (`channel` to answer on; on the links' threads once `start`ed; one that
    returns a string drops the record, saying why); `on_up(member)` a channel is up (either way);
    `on_lost(member, inc)` a member's connection ended without its goodbye (under the links' lock: it
    must not call Links)."""

    def __init__(self, addresses: list[tuple[str, int]], me: int, incarnation: str, secret: bytes, heartbeat_s: float,
                 lost_after_s: float, procs: int, *, heartbeat: Callable[[], Heartbeat], on_message: Callable,
                 on_up: Callable[[int], None], on_lost: Callable[[int, str], None],
                 pins: Callable[[], set[int]] = set):
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
        self._wake = threading.Event()  # the ticker looks again now (a member dialled in, a channel ended)
        self._stop = threading.Event()
        self._told_size = False  # a peer of another size of job was named once (it dials again and again)

    def start(self) -> None:
        # the ticker first: while the port is taken, the other members hear this one (starting), and
        # wait for it rather than end the job for want of a group
        self._threads = [threading.Thread(target=self._tick, daemon=True)]
        self._threads[0].start()
        try:
            self._server = self._listen()
        except BaseException:
            self._stop.set()
            raise
        # made here, not in the thread: a thread that starts late (a loaded node) may find no descriptor left
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        self._threads.append(threading.Thread(target=self._accept, args=(selector,), daemon=True))
        self._threads[-1].start()

    def targets(self) -> tuple[set[int], set[int]]:
        """(members to keep a channel to, members to dial now): the two lowest members up, the pinned,
        and a dial to every member below the second of those whose last dial did not fail just now
        (at most PROBES at once beyond the pinned: a job starting all at once does not dial every member)."""
        now = time.monotonic()
        with self._lock:
            up, dialing = set(self._senders), set(self._dialing)
        pins = {m for m in self.pins() if 0 <= m < len(self.addresses) and m != self.member}
        keep, dial, found = set(pins), {m for m in pins - up - dialing if self._retry.get(m, 0) <= now}, 0
        probes = len(dialing - pins)
        for m in range(len(self.addresses)):
            if m == self.member:
                continue
            if m in up:
                keep.add(m)
                found += 1
                if found == 2:
                    break
            elif m in dialing:
                keep.add(m)
            elif self._retry.get(m, 0) <= now and probes < PROBES:
                dial.add(m)
                probes += 1
        return keep, dial

    def name(self, member: int) -> str:
        """A member as the logs name it: "group 2", or "group 2 process 1" with several per group."""
        return f"group {member}" if self.procs == 1 else f"group {member // self.procs} process {member % self.procs}"

    def send(self, member: int, msg) -> None:
        """`msg` to `member` over a channel to it (this member's, else the member's); OSError if there is none.
        A channel being closed (a goodbye) is no channel: what is sent on it after its last flush is lost."""
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
        self._wake.set()
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
        """One peer's heartbeats and requests, once it completed the handshake and named itself (by
        `deadline`, from its accept: the accept loop shuts it down then)."""
        member = inc = channel = tls = None
        try:
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
            channel = Channel(tls, lambda line: self._deliver(line, self.name(member), "a message",
                                                               lambda msg: self._take_in(member, inc, msg, channel)),
                              sent=self.sent)
            try:  # the hello first, before the ticker knows the channel: a heartbeat ahead of it fails the dial
                channel.send(Hello(PROTOCOL, self.member, self.incarnation, len(self.addresses), member))
            except OSError:  # closed meanwhile (this member is closing)
                return
            with self._lock:  # this connection is now the member's: an older one's end says nothing of it
                self._inbound[member] = channel
                self._retry.pop(member, None)  # it is up: a dial to it (where this member wants one) goes now
                self._failures.pop(member, None)
            self._wake.set()
            with contextlib.suppress(OSError):  # (closed meanwhile: run ends at once)
                channel.send(self.heartbeat())
            self.on_up(member)
            channel.run()
        finally:
            with self._lock:  # only the member's newest connection says, by ending without a goodbye, that it is gone
                if member is not None and self._inbound.get(member) is channel:
                    del self._inbound[member]
                    if not channel.bye:
                        self.on_lost(member, inc)

    def _take_in(self, member: int, inc: str, msg, channel: Channel) -> str | None:
        if isinstance(msg, Bye):  # it no longer needs this channel: its end says nothing of it
            channel.bye = True
            return None
        return self.on_message(member, inc, msg, channel)

    def _deliver(self, line: bytes, who: str, what: str, handler: Callable[[object], str | None]) -> None:
        """A line from `who` into its record, for `handler`; dropped if not one of ours, or if `handler` says why."""
        try:
            msg = parse(line, len(self.addresses))
        except WireError as e:
            return self.drop(who, f"{what} that is not one of ours ({e})")
        if (why := handler(msg)) is not None:
            self.drop(who, why)

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
        """Every heartbeat_s (and at once when woken): channels out opened and closed as `targets` says,
        and the owner's heartbeat sent on every channel, out and in."""
        early, last, due = False, None, 0.0
        while not self._stop.is_set():
            keep, dial = self.targets()
            for m in dial:
                with self._lock:
                    self._dialing.add(m)
                threading.Thread(target=self._dial_to, args=(m,), daemon=True).start()
            with self._lock:
                out = dict(self._senders)
                channels = list(out.values()) + list(self._inbound.values())
            for m, channel in out.items():
                if m not in keep:  # not needed: said goodbye to, so its end is no loss there
                    with contextlib.suppress(OSError):
                        channel.send(Bye())
                    channel.bye = True
                    channel.close_after_flush()
            beat = self.heartbeat()
            if not early or beat != last:  # woken early with nothing new to say: the usual beat will do
                # what changed goes at once (woken early); with nothing new, a beat every heartbeat_s, or a
                # quarter of lost_after_s if longer: enough to be heard alive, and a coordinator of 32 groups
                # on a sixteenth of a core spent all of it on 620 beats a second
                last, line = beat, encode(beat)  # (encoded once for all)
                due = time.monotonic() + max(self.heartbeat_s, self.lost_after_s / 4)
                for channel in channels:
                    with contextlib.suppress(OSError):
                        channel.send(line)
            early = self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()

    def hurry(self, members) -> None:
        """Dial `members` now, not after their failed dials' wait (one of them may be back)."""
        with self._lock:
            for m in members:
                self._retry.pop(m, None)
        self._wake.set()

    def wake(self) -> None:
        """Heartbeats out now (the owner's news: the others hear it within a message, not a heartbeat later)."""
        self._wake.set()

    def _dial_to(self, member: int) -> None:
        """A channel to `member`'s beacon, for as long as it is up and wanted: heartbeats both ways,
        requests out and replies in."""
        channel = hello = None
        try:
            conn = socket.create_connection(self.addresses[member], timeout=max(self.lost_after_s, HANDSHAKE_S))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self._tls_client.wrap_socket(conn)
            tls.sendall(encode(Hello(PROTOCOL, self.member, self.incarnation, len(self.addresses), member)))
            hello = parse(read_line(tls), len(self.addresses))
            if (not isinstance(hello, Hello) or hello.member != member or hello.to != self.member
                    or hello.v != PROTOCOL):
                # a relay: whoever holds the address we dialled passed us on to another member
                self.drop(f"{self.name(member)}'s address", f"a server that is not {self.name(member)} ({hello})")
                tls.close()
                hello = None
                return
            inc = hello.inc
            channel = Channel(tls, lambda line: self._deliver(line, self.name(member), "a reply",
                                                              lambda msg: self.on_message(member, inc, msg, channel)),
                              sent=self.sent)
            with self._lock:
                self._senders[member] = channel
                self._dialing.discard(member)
            with contextlib.suppress(OSError):  # (closed meanwhile: run ends at once)
                channel.send(self.heartbeat())
            self.on_up(member)
            channel.run()
        except (OSError, WireError):
            hello = None
        finally:
            with self._lock:
                self._dialing.discard(member)
                if channel is not None and self._senders.get(member) is channel:
                    del self._senders[member]
                    if not channel.bye:  # (we said goodbye: it is not lost)
                        self.on_lost(member, hello.inc)
                if channel is None:  # not reached: dialled again after 2 heartbeats, twice that after another
                    # failure, up to lost_after_s, each spread by chance: a job of hundreds starting at once
                    # does not dial its coordinator (16 handshakes at once, the rest closed) in lockstep
                    self._failures[member] += 1
                    wait = min(self.lost_after_s, 2 * self.heartbeat_s * 2 ** min(self._failures[member] - 1, 8))
                    self._retry[member] = time.monotonic() + wait * random.uniform(0.5, 1.5)
                else:
                    self._failures.pop(member, None)
            if channel is not None:
                channel.close()
            # its place among the lowest members up goes to the next one now; a failed probe's, to a probe of
            # the next member down the list (a probe a tick: after a rack of the lowest members was SIGKILLed,
            # survivors took a second or more to dial the new coordinator, and some missed its first epoch)
            self._wake.set()
