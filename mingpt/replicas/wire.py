"""The replica groups' wire: mutual TLS keyed by the job secret, and named, typed messages.

Why TLS and not a framing of our own: both ends must prove the secret, the proof must bind both
parties and both sides' fresh randomness (a relayed answer must fail), and every later message must
be authenticated with replay protection. TLS 1.3 with a certificate on each side does all of that,
from the standard library's `ssl` (OpenSSL). The job's certificate is derived from the secret: an
Ed25519 key from an HMAC of it, and a self-signed certificate with fixed fields (Ed25519 signs
deterministically, so every process of the job makes the same bytes). Each side presents it and
trusts that certificate only, so a peer that completes the handshake holds the secret, and nobody
else can read, change or replay a byte. Inside the channel the server names itself in its `Hello`:
a client that dialled group 2's address and reached another member (a relay by whoever bound a
down group's port) hangs up, and the client names the member it dialled in its own `Hello`, so the
member it reached refuses it before it counts the connection as the client's.

Every line is one JSON object, parsed once here into its record (`Hello`, `Heartbeat`, `Join`,
`EpochNews` with its `Member`s, `Wait`, and in a large job the relays' `Up` and `Down` that carry
those of members further away); a line too long, not JSON, or with a field of the wrong type
or range is dropped (and counted by the caller).
The exchange's tensors (over gloo, which authenticates nothing) are named here too: `ShareRow`, `Vote`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import math
import os
import select
import ssl
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import NamedTuple

import torch

log = logging.getLogger("mingpt.replicas.beacon")

PROTOCOL = 10  # checked at hello: groups of another release refuse each other (10: an Up's members that say the same)
MAX_LINE = 256 * 1024  # an announcement of 1,000 members fits; a peer's reply is never read unbounded
HANDSHAKE_S = 2.0  # from accept to a peer's hello, at most: a connection slower than this is closed


class WireError(ValueError):
    """A message that is not one of ours: not JSON, an unknown kind, a field of the wrong type or range."""


# --- the messages -----------------------------------------------------------------------------------
STATES = ("starting", "forming", "training", "finished")


def _text(limit: int):
    return lambda v: isinstance(v, str) and len(v) <= limit


def _int(lo: int, hi: int = 2**62):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _bool(v) -> bool:
    return isinstance(v, bool)


def _column(kind: type, lo: int = 0, hi: int = 2**62):
    """A check of a column of an announcement's members, in built-ins (a check an entry took 3 ms at 1,024
    members, and every member reads every announcement): each of type `kind` (an int is not a bool), and
    each int within lo..hi, each text at most `hi` long."""
    def check(c) -> bool:
        if not isinstance(c, list) or not set(map(type, c)) <= {kind}:
            return False
        return not c or kind is bool or (lo <= min(c) and max(c) <= hi if kind is int else max(map(len, c)) <= hi)
    return check


def _id(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 32 and all(c in "0123456789abcdef" for c in v)


@dataclass(frozen=True)
class Hello:
    """The first line each way inside the channel: who is speaking, and which job layout it counts."""
    v: int
    member: int  # the sender's member number (group * processes per group + process)
    inc: str  # the sender's incarnation: a restarted process is a new member
    members: int  # members in the job (every group's processes): its numbering must be ours
    to: int  # the member it is for: a client's hello relayed to another member is refused there


@dataclass(frozen=True)
class Heartbeat:
    """A member's state, every heartbeat_s, both ways on each channel. The last four are what an epoch's
    coordinator (which hears every member) tells the members (which hear only a few): its verdict."""
    state: str  # starting (building), forming (asking to join an epoch), training, finished (the last step applied)
    epoch: int  # the newest epoch it trained in (-1: none)
    step: int
    taking: int  # the epoch it is forming (-1: none)
    why: str = ""  # why its last epoch ended (its root cause)
    ended: str = ""  # the coordinator's: why `epoch` cannot go on ("": it goes on)
    cause: str = ""  # the coordinator's: the root cause of that
    done: bool = False  # the coordinator's: every member of `epoch` has finished the run
    groups: int = 0  # the coordinator's: the groups it hears alive (for a quorum)


@dataclass(frozen=True)
class Bye:
    """A member no longer needs this channel (it closes it next): its end is no loss."""


@dataclass(frozen=True)
class Join:
    """A request to the coordinator to be in the next epoch."""
    id: str
    step: int  # the steps its state holds (its claim: the coordinator checks it against its record)
    live: bool  # it trained in an epoch (a claim, likewise)
    epoch_seen: int  # the newest epoch it has heard of
    store: int  # the port of its rendezvous store, on its beacon's host (where its links meet: Member.store)


class Member(NamedTuple):
    """A member (one process) as an epoch knows it. (A tuple: an announcement's thousand are made at C speed.)"""
    number: int  # its member number: group * processes per group + process
    incarnation: str  # this process's start: a restarted group is a new member
    step: int  # the steps its state holds
    live: bool  # it has trained in an epoch (its state is the job's, not a snapshot's)
    store: int  # the port of its rendezvous store, on its beacon's host: each pair of the epoch's links meets
    # on the store of its lower-ranked member (a store per member, not one for all on the coordinator)


def counts_in(members, number: int, incarnation: str) -> bool:
    """Whether `members` (an epoch's) count this process: the member `number` in its `incarnation`."""
    return any(m.number == number and m.incarnation == incarnation for m in members)


@dataclass(frozen=True)
class EpochNews:
    """The coordinator's answer: the epoch, its members in rank order, and its key (drawn by the coordinator:
    the names its links meet under, in stores that outlive an epoch, are this epoch's alone)."""
    id: str
    number: int
    key: str
    members: tuple[Member, ...]


@dataclass(frozen=True)
class Wait:
    """The coordinator's answer: no epoch for you now (your group is not whole, or there is no quorum); ask again."""
    id: str


@dataclass(frozen=True)
class Up:
    """Records a relay passes up a large job's tree (link.py), from the members below it towards the
    root: (member, its incarnation, its Heartbeat or Join; None: the member's connection to the one
    below the relay ended without a goodbye); and the members below whose heartbeat is the one this
    channel carried for them last (`same`: they are alive, and say nothing new)."""
    items: tuple
    same: tuple = ()


@dataclass(frozen=True)
class Down:
    """Records passed down a large job's tree from its root: (member, its incarnation, the member a
    record is for (-1: every member), its Heartbeat, EpochNews or Wait; None: its connection ended)."""
    items: tuple


KINDS = {"hello": Hello, "hb": Heartbeat, "bye": Bye, "join": Join, "epoch": EpochNews, "wait": Wait, "up": Up,
         "down": Down}
NAMES = {cls: name for name, cls in KINDS.items()}
REQUIRED = {cls: frozenset(f.name for f in fields(cls) if f.default is MISSING) for cls in KINDS.values()}


@functools.lru_cache(maxsize=8)
def checks(members: int) -> dict:
    """Each field's check, for a job of `members` members (built once per job size: every line is parsed)."""
    member = _int(0, members - 1)
    entry = {"number": _column(int, 0, members - 1), "incarnation": _column(str, 0, 32), "step": _column(int),
             "live": _column(bool), "store": _column(int, 1, 65535)}
    return {
        Hello: {"v": _int(0, 2**31), "member": _int(0, 2**31), "inc": _text(32), "members": _int(1, 2**31),
                "to": _int(0, 2**31)},
        Heartbeat: {"state": lambda v: v in STATES, "epoch": _int(-1), "step": _int(0), "taking": _int(-1),
                    "why": _text(300), "ended": _text(300), "cause": _text(300), "done": _bool, "groups": _int(0, members)},
        Bye: {},
        Join: {"id": _id, "step": _int(0), "live": _bool, "epoch_seen": _int(-1), "store": _int(1, 65535)},
        EpochNews: {"id": _id, "number": _int(0), "key": _id,
                    # (by column: a thousand members' entries each a JSON object took 3 ms to read, here)
                    "members": lambda v: isinstance(v, dict) and set(v) == set(entry)
                    and isinstance(v["number"], list) and 0 < len(v["number"]) <= members
                    and all(entry[k](c) and len(c) == len(v["number"]) for k, c in v.items())},
        Wait: {"id": _id},
        Up: {"items": _items(members, 3, (Heartbeat, Join)),
             "same": lambda v: isinstance(v, list) and len(v) <= members and all(map(member, v))},
        Down: {"items": _items(members, 4, (Heartbeat, EpochNews, Wait))},
    }


def _items(members: int, width: int, kinds: tuple):
    """A check of a relay's items: at most two a member, each [member, incarnation, (for whom,) record
    of one of `kinds` or None]; the records are checked as they are read (`_record`)."""
    member, inc, to = _int(0, members - 1), _text(32), _int(-1, members - 1)

    def check(v) -> bool:
        return isinstance(v, list) and len(v) <= 2 * members and all(
            isinstance(i, list) and len(i) == width and member(i[0]) and inc(i[1]) and (width == 3 or to(i[2]))
            and (i[-1] is None or isinstance(i[-1], dict) and KINDS.get(i[-1].get("t")) in kinds) for i in v)
    return check


def parse(line: bytes, members: int):
    """One line into its record; WireError if it is not one of ours."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise WireError("not JSON") from None
    return _record(obj, members)


def _record(obj, members: int):
    if not isinstance(obj, dict) or obj.get("t") not in KINDS:
        raise WireError(f"an unknown message {str(obj.get('t') if isinstance(obj, dict) else type(obj).__name__)[:20]!r}")
    cls = KINDS[obj.pop("t")]
    spec = checks(members)[cls]
    if not obj.keys() <= spec.keys() or not REQUIRED[cls] <= obj.keys():
        raise WireError(f"a {NAMES[cls]} with fields {sorted(obj)[:10]}")
    for k, v in obj.items():
        if not spec[k](v):
            raise WireError(f"a {NAMES[cls]} whose {k} is {str(v)[:40]!r}")
    if cls is EpochNews:
        columns = [obj["members"][name] for name in Member._fields]
        obj["members"] = tuple(map(Member, *columns))  # (a generator of Member(*m) was most of a parse's time)
    elif cls in (Up, Down):
        obj["items"] = tuple((*i[:-1], None if i[-1] is None else _record(i[-1], members)) for i in obj["items"])
        if "same" in obj:
            obj["same"] = tuple(obj["same"])
    return cls(**obj)


def _fields(msg) -> dict:
    """A record as the wire writes it."""
    if isinstance(msg, EpochNews):
        columns = dict(zip(Member._fields, map(list, zip(*msg.members))))
        return {"t": "epoch", "id": msg.id, "number": msg.number, "key": msg.key, "members": columns}
    if isinstance(msg, (Up, Down)):
        items = [[*i[:-1], None if i[-1] is None else _fields(i[-1])] for i in msg.items]
        return {"t": NAMES[type(msg)], "items": items, **({"same": list(msg.same)} if getattr(msg, "same", ()) else {})}
    return {"t": NAMES[type(msg)], **vars(msg)}  # (flat records: asdict's deep copy was most of a relay's time)


def encode(msg) -> bytes:
    return json.dumps(_fields(msg)).encode() + b"\n"


def bounded(cls, items: list) -> list[bytes]:
    """`items` as `cls` lines (Up or Down), each within half of MAX_LINE. (A relay's answers to the members
    below one child, each an announcement of 512 members, made one line of over a megabyte: the child
    refused it and closed the channel, and each new epoch brought more answers.)"""
    line = encode(cls(tuple(items)))
    if len(line) <= MAX_LINE // 2 or len(items) == 1:
        return [line]
    return bounded(cls, items[:len(items) // 2]) + bounded(cls, items[len(items) // 2:])


# --- the exchange's tensors (over gloo) ------------------------------------------------------------
class ShareHeader(NamedTuple):
    """What a share's trainer sends with its gradient row, as float64 columns in this order."""
    preempted: float  # a preemption signal at that member
    timed: float  # the save interval elapsed at that member
    joiners: float  # a group waits to join (that member sees it ready)
    loss: float  # the share's summed token loss
    samples: float  # how many samples it trained
    ids: float  # the sum of their ids (every member trains the same samples of a share, whoever it is)
    group: float  # the group that trained it (its member's group)
    compute: float  # that member's seconds computing its shares of the step (the report's time per group)


class Flags(NamedTuple):
    """What the members of a step agree on: whether any of them saw each (a ShareHeader's columns; a
    stop signal is told per share, for the group that trained it: it stops that group only)."""
    timed: float
    joiners: float

    @classmethod
    def of(cls, headers) -> Flags:
        return cls(*(float(any(getattr(h, f) for h in headers)) for f in cls._fields))


MAC_COLUMNS = 4  # a row's HMAC-SHA256, its 32 bytes carried as four float64 columns


def _mac(key: bytes, row: torch.Tensor) -> bytes:
    return hmac.new(key, row.contiguous().numpy().tobytes(), hashlib.sha256).digest()


class ShareRow(NamedTuple):
    """A share's row in the exchange's table of headers: the share, its step and epoch, the gradient row
    of its sender that carries it (alone, or folded with the rest of its owner's shares), and its header;
    float64 columns, then their HMAC keyed by the job secret (a forged row ends the exchange)."""
    share: int
    step: int
    epoch: int
    row: int
    header: ShareHeader

    WIDTH = 4 + len(ShareHeader._fields) + MAC_COLUMNS  # (a class constant, not a field)

    def pack(self, key: bytes) -> torch.Tensor:
        row = torch.tensor([self.share, self.step, self.epoch, self.row, *self.header], dtype=torch.float64)
        return torch.cat([row, torch.frombuffer(bytearray(_mac(key, row)), dtype=torch.float64)])

    @classmethod
    def unpack(cls, t: torch.Tensor, key: bytes) -> ShareRow | None:
        """The row `t` holds; None for padding (-1: fewer shares than another member); WireError without the MAC."""
        row = t[:-MAC_COLUMNS]
        if row[0] < 0:
            return None
        if not hmac.compare_digest(t[-MAC_COLUMNS:].contiguous().numpy().tobytes(), _mac(key, row)):
            raise WireError("a row without the job's MAC")
        share, step, epoch, grad_row, *header = row.tolist()
        return cls(int(share), int(step), int(epoch), int(grad_row), ShareHeader(*header))


class Vote(NamedTuple):
    """A sharded group's processes' vote after each exchange, summed over their own process group as
    float64: how many did not complete it, how many saw each flag, and each share's [samples, ids,
    stop signals at its trainers]."""
    failed: float
    flags: Flags
    counts: list  # in share order ([] from a process whose exchange failed)

    def pack(self, shares: int) -> torch.Tensor:
        counts = [x for c in self.counts or [[0.0, 0.0, 0.0]] * shares for x in c]
        return torch.tensor([self.failed, *self.flags, *counts], dtype=torch.float64)

    @classmethod
    def unpack(cls, t: torch.Tensor, shares: int) -> Vote:
        return cls(float(t[0]), Flags(*t[1:3].tolist()), t[3:].view(shares, 3).tolist())


# --- the channel ------------------------------------------------------------------------------------
def credentials(secret: bytes) -> tuple[bytes, bytes]:
    """The job's certificate and private key (PEM), the same bytes in every process that holds `secret`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.x509.oid import NameOID

    key = Ed25519PrivateKey.from_private_bytes(hmac.new(secret, b"mingpt replicas tls key", hashlib.sha256).digest())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mingpt replica job")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
            .not_valid_after(datetime.datetime(9999, 12, 31))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, None))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@functools.lru_cache(maxsize=4)
def contexts(secret: bytes) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS 1.3 contexts that present the job's certificate and trust it alone (made once a
    process: the membership bench runs a hundred beacons in one)."""
    cert, key = credentials(secret)
    out = []
    for protocol in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # every member presents the job's certificate: the Hello names the member
        ctx.verify_mode = ssl.CERT_REQUIRED
        with _private_file(cert + key) as path:  # ssl loads a key from a file only
            ctx.load_cert_chain(path)
        ctx.load_verify_locations(cadata=cert.decode())
        out.append(ctx)
    return out[0], out[1]


@contextlib.contextmanager
def _private_file(data: bytes):
    """A path to `data` that no other user can open: an anonymous memory file (Linux), else a file in a
    new 0700 directory, removed at once."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("mingpt-replicas", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory() as d:  # mkdtemp: mode 0700
        path = os.path.join(d, "job.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
            fh.write(data)
        yield path


class Channel:
    """One authenticated connection, read and written by the process's `Reactor` once `start`ed: it hands
    each line read to `on_line` (on the reactor's thread), and writes what any thread `send`s. It ends
    when the peer hangs up, a line exceeds MAX_LINE, `on_line` raises, `close` is called, or a send makes
    no progress for `send_timeout_s` (a cut network); then `on_end` runs, once, on the reactor's thread."""

    def __init__(self, sock: ssl.SSLSocket, on_line: Callable[[bytes], None], send_timeout_s: float = 1.0,
                 sent: Counter | None = None):
        self.sock, self.on_line, self.send_timeout_s = sock, on_line, send_timeout_s
        self.sent = Counter() if sent is None else sent  # messages and bytes sent (its owner's tally, if given)
        self._out: deque[bytes] = deque()
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self.heard = time.monotonic()  # when its last line came
        self.said = 0.0  # when its last line was queued
        self.last: tuple[bytes, object] = (b"", None)  # its last line read, and its record (`Links._deliver`)
        self.beats: dict[int, tuple] = {}  # (a relay's channel) each member's heartbeat it carried last: (inc, beat)
        self.bye = False  # it ends by a goodbye (either way): no loss
        self._closing = False  # close once what is queued is sent
        self._on_end: Callable[[], None] | None = None
        self._buf = b""  # read, not yet a whole line
        self._unsent = b""  # taken from _out, not yet taken by the socket
        self._stuck_since: float | None = None  # the socket took nothing since (its peer reads nothing)

    def start(self, on_end: Callable[[], None] = lambda: None) -> None:
        """Hands the connection to the reactor: `on_end` runs once it ended (at once, if it is closed)."""
        self._on_end = on_end
        with contextlib.suppress(OSError):  # (closed meanwhile, by its owner's end: the reactor ends it)
            self.sock.setblocking(False)
        Reactor.get().attend(self)

    def send(self, msg) -> None:
        """`msg`, a record (or a line already encoded), sent by the reactor."""
        if self.closed.is_set() or self._closing:
            raise OSError("the connection is closed")
        data = msg if isinstance(msg, bytes) else encode(msg)
        with self._lock:
            self._out.append(data)
            self.said = time.monotonic()
            self.sent["messages"] += 1
            self.sent["bytes"] += len(data)
        if self._on_end is not None:
            Reactor.get().attend(self)

    def close_after_flush(self) -> None:
        self._closing = True
        if self._on_end is not None:
            Reactor.get().attend(self)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._on_end is not None:
            Reactor.get().attend(self)
        else:  # (never started: nobody else holds the socket)
            with contextlib.suppress(OSError):
                self.sock.close()

    # --- on the reactor's thread ---------------------------------------------------------------------
    def _read(self) -> None:
        """What came, up to what TLS holds decrypted (the poll says when more is on the socket: a read to
        find it empty was a system call a line)."""
        while True:
            try:
                data = self.sock.recv(65536)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return
            if not data:
                raise EOFError
            self.heard = time.monotonic()
            *lines, self._buf = (self._buf + data).split(b"\n")
            if len(self._buf) > MAX_LINE:
                raise WireError(f"a line over {MAX_LINE} bytes")
            for line in lines:
                self.on_line(line)
            if not isinstance(self.sock, ssl.SSLSocket) or not self.sock.pending():
                return

    def _flush(self) -> bool:
        """Writes what is queued, as far as the socket takes it; whether all of it went."""
        while True:
            if not self._unsent:
                with self._lock:
                    if not self._out:
                        self._stuck_since = None
                        return True
                    self._unsent = b"".join(self._out)  # (the lines queued since, in one write)
                    self._out.clear()
            try:
                n = self.sock.send(self._unsent)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                n = 0
            if n == 0:
                if self._stuck_since is None:
                    self._stuck_since = time.monotonic()
                return False
            self._unsent, self._stuck_since = self._unsent[n:], None

    def _end(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        on_end, self._on_end = self._on_end, lambda: None
        on_end()


class Reactor:
    """The one thread of a process that reads and writes every started `Channel` and runs what is due
    (`call_at`: the beacons' ticks): a poll over their sockets, woken through a pipe when a channel has
    lines to send or is to close, or a call is asked for sooner. A thread per channel and a ticker per
    beacon, woken by every line and every beat, cost a beacon of a large job more in thread switches than
    in work (threads a member: 5 with fan_out 6; CPU a member: 2.6 to 3.6 ms a second)."""

    _instance: Reactor | None = None
    _made = threading.Lock()
    idle_s = 1.0  # the longest poll with nothing due (a stuck send is looked at every 0.1 s)

    @classmethod
    def get(cls) -> Reactor:
        with cls._made:  # (one a process: a forked child makes its own)
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self.pid = os.getpid()
        self._poll = select.poll()  # (poll, not select: a process may hold more than 1,024 descriptors)
        self._by_fd: dict[int, Channel] = {}
        self._lock = threading.Lock()
        self._due: set[Channel] = set()  # channels with lines to send, new, or to close
        self._calls: list[tuple[float, int, Callable[[], None]]] = []  # a heap: (when, order, what)
        self._order = itertools.count()
        self._woken = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, select.POLLIN)
        self._ident: int | None = None  # (the reactor's thread, once started)
        thread = threading.Thread(target=self._run, daemon=True, name="replica-channels")
        thread.start()
        self._ident = thread.ident

    def attend(self, channel: Channel) -> None:
        """`channel` looked at on the next turn (its queue written, its start or end taken)."""
        with self._lock:
            self._due.add(channel)
            self._wake_up()

    def call_at(self, when: float, what: Callable[[], None]) -> None:
        """`what()` on the reactor's thread at `when` (time.monotonic()), or as soon after as it can. It must
        not block: every channel of the process waits for it."""
        with self._lock:
            heapq.heappush(self._calls, (when, next(self._order), what))
            if self._calls[0][2] is what:  # (else the earlier call wakes it)
                self._wake_up()

    def _wake_up(self) -> None:
        """(Under the lock) the reactor's poll ends now, unless a wake-up is pending already, or this is the
        reactor's own thread (its next poll waits for nothing then: a line a relay passed on, or a tick's
        beat, each wrote the pipe and read it back)."""
        if not self._woken and threading.get_ident() != self._ident:
            self._woken = True
            with contextlib.suppress(OSError):  # (a full pipe: a wake-up is pending anyway)
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        stuck: set[Channel] = set()  # channels whose socket took not all that was queued
        while True:
            with self._lock:
                wait = 0 if self._due else min(0.1 if stuck else self.idle_s,
                                               self._calls[0][0] - time.monotonic() if self._calls else self.idle_s)
            events = self._poll.poll(max(0, math.ceil(wait * 1000)))
            # the pipe emptied before `_woken` is cleared: a wake-up written after this is read next turn (emptied
            # after it, one written between was lost with `_woken` left set: the reactor slept until its next call)
            if any(fd == self._wake_r for fd, _ in events):
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 65536)
            with self._lock:
                due, self._due, self._woken = self._due, set(), False
                now, calls = time.monotonic(), []
                while self._calls and self._calls[0][0] <= now:
                    calls.append(heapq.heappop(self._calls)[2])
            for what in calls:
                try:
                    what()
                except Exception:  # the reactor serves the process's other beacons
                    log.exception("replica beacon: a call on the reactor failed")
            for fd, what in events:
                if fd != self._wake_r and (channel := self._by_fd.get(fd)) is not None:
                    self._turn(channel, stuck, read=bool(what & ~select.POLLOUT))
                    due.discard(channel)
            for channel in due:
                self._turn(channel, stuck, read=False)
            now = time.monotonic()
            for channel in [c for c in stuck if now - c._stuck_since > c.send_timeout_s]:
                self._drop(channel, stuck)

    def _turn(self, channel: Channel, stuck: set, read: bool) -> None:
        fd = channel.sock.fileno()
        if channel._on_end is None:
            return
        if fd < 0 or channel.closed.is_set():  # (closed, or ended already: its end runs once)
            return self._drop(channel, stuck)
        if fd not in self._by_fd:
            self._by_fd[fd] = channel
            self._poll.register(fd, select.POLLIN)
            read = True  # (what came before it was started)
        try:
            if read:
                channel._read()
            flushed = channel._flush()
        except (OSError, EOFError, WireError):
            return self._drop(channel, stuck)
        except Exception:  # a fault of its handler ends this channel, not the process's others
            log.exception("replica channel: a line's handler failed")
            return self._drop(channel, stuck)
        if flushed and channel._closing:
            return self._drop(channel, stuck)
        if flushed != (channel not in stuck):
            (stuck.discard if flushed else stuck.add)(channel)
            self._poll.modify(fd, select.POLLIN | (0 if flushed else select.POLLOUT))

    def _drop(self, channel: Channel, stuck: set) -> None:
        stuck.discard(channel)
        fd = channel.sock.fileno()
        if self._by_fd.get(fd) is channel:
            del self._by_fd[fd]
            self._poll.unregister(fd)
        try:
            channel._end()
        except Exception:  # the reactor serves the process's other channels
            log.exception("replica channel: its end failed")


def read_line(sock: ssl.SSLSocket, limit: int = 4096) -> bytes:
    """One line during the hello (before the channel runs), at most `limit` bytes."""
    buf = b""
    while b"\n" not in buf:
        data = sock.recv(limit + 1 - len(buf))
        if not data:
            raise OSError("closed during the hello")
        buf += data
        if len(buf) > limit:
            raise WireError("a hello over its size")
    line, rest = buf.split(b"\n", 1)
    if rest:  # the peer speaks only after the other side's hello: nothing may follow it yet
        raise WireError("data after the hello")
    return line
