"""A replica member's links: a TLS server on its own address (the other members' heartbeats and
join requests) and a channel to every other member (its heartbeats and requests out, replies in).
Sockets, threads, the handshake and the hello live here; what the lines mean is the Beacon's
(mingpt/replicas/beacon.py), through `_heard` and `_reply`."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import Counter

from mingpt.replicas.wire import (
    HANDSHAKE_S,
    PROTOCOL,
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

HANDSHAKES = 16  # connections that have not yet proved the secret, at once: more are closed unread


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


def member_addresses(peers: list[str], procs: int) -> list[str]:
    """Every member's beacon address: process i of a group listens on its peers entry's port + i."""
    out = []
    for peer in peers:
        host, port = host_port(peer)
        out += [f"[{host}]:{port + i}" if ":" in host else f"{host}:{port + i}" for i in range(procs)]
    if len(set(out)) != len(out):
        raise ReplicaError(f"with {procs} processes per group, group g's processes listen on its replicas.peers "
                           f"port and the {procs - 1} after it: these overlap in {peers}; space the ports at "
                           f"least {procs} apart")
    return out


class Links:
    """The sockets of member `me` of `peers` (every member's (host, port)); a subclass answers the
    lines they carry (`_heard`, `_reply`) and names members (`name`)."""

    def __init__(self, peers: list[tuple[str, int]], me: int, secret: bytes, heartbeat_s: float,
                 lost_after_s: float, bind_wait_s: float):
        self.peers, self.heartbeat_s, self.lost_after_s = peers, heartbeat_s, lost_after_s
        self.dropped: Counter = Counter()  # messages and connections dropped, by sender
        self._tls_server, self._tls_client = contexts(secret)
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        self._senders: dict[int, Channel] = {}
        # a member that dialled in is up: the sender to it dials now if it waits to (a returning member
        # hears this one within a handshake, not up to a heartbeat later; set while connected, it only
        # spares the sender's next wait once)
        self._dial = {m: threading.Event() for m in range(len(peers)) if m != me}
        # news of a member (heard from anew, or a channel to it up): a member forming an epoch looks again
        self._news = threading.Event()
        self._stop = threading.Event()
        self._told_size = False  # a peer of another size of job was named once (its sender retries every heartbeat)
        self._server = self._listen(bind_wait_s)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads += [threading.Thread(target=self._send, args=(m,), daemon=True)
                          for m in range(len(self.peers)) if m != me]
        for t in self._threads:
            t.start()

    def _listen(self, wait_s: float) -> socket.socket:
        """A listener on this member's address only (nothing listens wider than it must). A port held
        by another process (a previous incarnation's lingering socket, or another user) is tried again
        with backoff for `wait_s`, the holder named where /proc tells it."""
        host, port = self.peers[self.member]
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        deadline, pause = time.monotonic() + wait_s, 0.5
        while True:
            server = socket.socket(family, kind, proto)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(address)
                server.listen(64)
                return server
            except OSError as e:
                server.close()
                if e.errno != errno.EADDRINUSE or time.monotonic() + pause > deadline:
                    raise ReplicaError(f"replica {self.name(self.member)} cannot listen on {host}:{port} ({e.strerror}"
                                       f"{port_holder(port)}): give replicas.peers an address of this host with a free "
                                       "port" + (f" (and the {self.procs - 1} after it)" if self.procs > 1 else "")) from None
                log.warning("replica %s cannot listen on %s:%d yet (%s%s); trying again in %.0f s", self.name(self.member),
                            host, port, e.strerror, port_holder(port), pause)
                time.sleep(pause)
                pause = min(2 * pause, 10.0)

    def close(self) -> None:
        self._stop.set()
        for s in [self._server, *self._senders.values()]:
            try:
                s.close()
            except OSError:
                pass

    def _write(self, conn: Channel | None, msg) -> None:
        if conn is None:
            raise OSError("not connected")
        conn.send(msg)

    def _drop(self, who: str, why: str) -> None:
        """A message that is not one of ours, or a connection that did not prove the secret: dropped,
        counted, and logged the first time for each sender."""
        with self._lock:
            self.dropped[who] += 1
            first = self.dropped[who] == 1
        if first:
            log.warning("replica beacon: dropped %s from %s (logged once; `dropped` counts them)", why, who)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, address = self._server.accept()
            except OSError as e:
                if self._stop.is_set():
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._drop("the accept loop", f"a connection ({e.strerror}: out of descriptors)")
                    time.sleep(0.05)  # connections close meanwhile; the listener stays
                    continue
                return
            if not self._handshakes.acquire(blocking=False):  # unauthenticated connections are capped
                conn.close()
                self._drop("the accept loop", f"a connection beyond {HANDSHAKES} unauthenticated ones")
                continue
            threading.Thread(target=self._serve, args=(conn, address), daemon=True).start()

    def _serve(self, conn: socket.socket, address) -> None:
        """One peer's heartbeats and requests, once it completed the handshake and named itself."""
        member = inc = None
        try:
            try:
                conn.settimeout(HANDSHAKE_S)
                tls = self._tls_server.wrap_socket(conn, server_side=True)
                hello = parse(read_line(tls), len(self.peers))
            except (OSError, WireError) as e:
                conn.close()
                self._drop(str(address[0]), f"a connection that did not prove the job secret ({e})")
                return
            finally:
                self._handshakes.release()
            if not self._welcome(hello, tls):
                tls.close()
                return
            member, inc = hello.member, hello.inc
            self._dial[member].set()
            channel = Channel(tls, lambda line: self._heard(member, inc, channel, line))
            channel.send(Hello(PROTOCOL, self.member, self.incarnation, len(self.peers)))
            channel.run()
        finally:
            with self._lock:
                if member is not None and self._seen.get(member, {}).get("inc") == inc:
                    self._seen[member]["eof"] = True

    def _welcome(self, hello, tls) -> bool:
        """Whether a peer's hello (it holds the secret) is of this job's protocol and layout."""
        if not isinstance(hello, Hello) or hello.v != PROTOCOL:
            self._drop("a peer", f"a hello of another protocol ({hello})")
            return False
        if hello.members != len(self.peers):  # its member numbers are not ours: it must not join
            if not self._told_size:
                self._told_size = True
                log.error("replica beacon: refused a peer of this job that counts %s processes in all, where this "
                          "one counts %d: start every group with the same --nproc_per_node and replicas.peers",
                          hello.members, len(self.peers))
            return False
        if not 0 <= hello.member < len(self.peers) or hello.member == self.member:
            self._drop("a peer", f"a hello from member {hello.member}")
            return False
        tls.settimeout(None)
        return True

    def _send(self, member: int) -> None:
        """Keep a channel to `member`'s beacon: heartbeats out, replies to our requests in."""
        while not self._stop.is_set():
            channel = None
            try:
                conn = socket.create_connection(self.peers[member], timeout=max(self.lost_after_s, HANDSHAKE_S))
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tls = self._tls_client.wrap_socket(conn)
                tls.sendall(encode(Hello(PROTOCOL, self.member, self.incarnation, len(self.peers))))
                hello = parse(read_line(tls), len(self.peers))
                if not isinstance(hello, Hello) or hello.member != member or hello.v != PROTOCOL:
                    # a relay: whoever holds the address we dialled passed us on to another member
                    self._drop(f"{self.name(member)}'s address", f"a server that is not {self.name(member)} ({hello})")
                    tls.close()
                    time.sleep(self.heartbeat_s)
                    continue
                channel = Channel(tls, self._reply)
                self._senders[member] = channel
                self._news.set()
                threading.Thread(target=channel.run, daemon=True).start()
                while not self._stop.is_set() and not channel.closed.is_set():
                    with self._lock:
                        status = dict(self.status)
                    channel.send(Heartbeat(**status))
                    channel.closed.wait(self.heartbeat_s)
            except (OSError, WireError):
                pass
            if self._senders.get(member) is channel:
                self._senders.pop(member, None)
            if channel is not None:
                channel.close()
            self._dial[member].wait(self.heartbeat_s)
            self._dial[member].clear()

