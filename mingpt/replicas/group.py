"""A replica group as the Trainer uses it: the shares of a step it trains, the exchange of their
gradients in share order, and healing from a live peer. See mingpt/replicas/__init__.py."""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mingpt.replicas.beacon import Beacon, Epoch, MembershipChanged
from mingpt.replicas.link import ReplicaError, member_addresses
from mingpt.replicas.members import model_of
from mingpt.replicas.tensors import MAX_STATE_JSON, Rows, buckets, byte_view, heal_tag, set_grads, state_digest, unpack_state
from mingpt.replicas.wire import ShareHeader, ShareRow, WireError
from mingpt.runtime import distributed
from mingpt.runtime.distributed import DistInfo

log = logging.getLogger(__name__)


SWITCH_S = 0.0005  # the interpreter's switch interval in a member (Python's default: 5 ms)
LOOK_S = 0.005  # how often a wait for a collective asks the beacon whether a member was lost
LEAVING_GRACE_S = 0.05  # at most this is added to the survivors' gap when a member is really lost


class ReplicaExit(Exception):
    """A replica group's process leaves early with `code`: a process of its group was lost (1: its torchrun restarts
    them all), or a spare ended before it took its member's place (stopped: 75; the run finished: 0)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Healed:
    """What a heal did: the member that sent its state (None: all held the same), the members it brought forward."""
    source: int | None
    members: list[int]


def ring_gather(ring, me: int, world: int, t: torch.Tensor, tag: int) -> torch.Tensor:
    """Every member's `t`, in rank order, passed round the ring (each member talks to its two
    neighbours only): world - 1 rounds of one `t` each."""
    ring.connect(ring.neighbours())
    out = torch.empty(world, *t.shape, dtype=t.dtype)
    out[me] = t
    for i in range(world - 1):
        sent = ring.send(out[(me - i) % world], (me + 1) % world, tag + i)
        ring.recv(out[(me - i - 1) % world], (me - 1) % world, tag + i).wait()
        sent.wait()
    return out


def ring_broadcast(ring, me: int, world: int, t: torch.Tensor, source: int, tag: int, chunk: int) -> None:
    """`t` (flat) from rank `source` to every member, passed on round the ring a chunk at a time: each
    member receives it once and sends it on once, and passes a chunk on while it receives the next."""
    at, pending = (me - source) % world, []
    for c, lo in enumerate(range(0, t.numel(), chunk)):
        part = t[lo:lo + chunk]
        if at > 0:
            ring.recv(part, (me - 1) % world, tag + c).wait()
        if at + 1 < world:
            pending.append(ring.send(part, (me + 1) % world, tag + c))
    for work in pending:
        work.wait()


def member_view(info: DistInfo, sharded: bool = False) -> DistInfo:
    """A process of a replica group as the rest of the program sees it: a process of its own, on its
    GPU (it trains with the group's other processes over the replicas' exchange, as a member like any
    other, not over its torchrun's process group); `sharded` (FSDP or tensor parallelism inside the
    group): a rank of its group's torchrun, whose processes split the model between them."""
    if info.world_size != info.local_world_size:
        raise ReplicaError(f"a replica group is one node's torchrun, and this one spans {info.world_size} processes "
                           f"on several nodes: run one group per node (torchrun --nnodes=1), each in replicas.peers")
    if sharded:
        return info
    return replace(info, rank=0, local_rank=0, world_size=1, local_world_size=1, node=0)


class _InThread:
    """A function run in a thread of its own, waited for as a collective is (`Replicas.wait`): gloo's
    point-to-point work says it is completed only once waited for, so the thread waits on it, and says
    when it is done (`done`)."""

    def __init__(self, fn: Callable[[], object]):
        self.out: dict = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - raised again to the waiting thread
            self.out["error"] = e
        finally:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> object:
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]


class Replicas:
    """This process's side of a replica-group job, as the Trainer uses it: which shares of the step it
    trains, the exchange of the shares' gradients, forming the next epoch, and healing. Every process of
    every group is a member (group g's process i is member g * procs + i)."""

    CHUNK = 1 << 22  # elements of the running sum passed on at a time (16 MB in fp32)
    # the point-to-point tags of the exchange (by chunk, round or share) and the healing
    _TAG_SUM, _TAG_TOTAL, _TAG_SHARE, _TAG_HEADERS, _TAG_HEAL = 0, 1 << 28, 1 << 29, 3 << 28, 1 << 30

    def __init__(self, beacon: Beacon, members: int, min_groups: int, timeout_s: float, per_group: int = 1,
                 tp: int = 1):
        # `members` counts every group's processes; the beacon knows the processes per group
        self.beacon, self.members, self.min_groups, self.timeout_s = beacon, members, min_groups, timeout_s
        # how the group's processes take part (mingpt/replicas/members.py): shares of every global step per
        # member (member m owns m*k .. m*k+k-1), or per group, whose processes train each share together
        self.membership = model_of(beacon.sharded, beacon.procs)(beacon, tp)
        self.per_group = per_group
        self.shares_total = (members // self.membership.unit) * per_group
        self.epoch: Epoch | None = None
        # An epoch whose transfer a lost member left unfinished keeps its links until that transfer ends
        # (at their timeout at the latest): freeing them sooner would wait in gloo's destructor (joining
        # its threads). Any other is freed with its sockets when the next epoch forms.
        self._retired: list[Epoch] = []
        self.live = False  # trained in an epoch: this state is the job's
        self.rejoin_pending = False  # a group waits to join, or one leaves: form a new epoch after this step
        self.leaving: list[int] = []  # the groups other than this one that a stop signal took out, at the last exchange
        self.staying = 0  # the groups of the epoch that no stop signal took out, at the last exchange
        # (this group's stop signal, the save interval elapsed on any member or a group leaving), at the last exchange
        self.flags = (False, False)
        self.shares_record: list = []  # the last step's (group that trained it, samples, sum of sample ids) of each share
        self.group_compute: list = []  # the last step's [group, compute ms] of every group in it (its slowest process)
        self.failed_heals = 0  # states received that did not match their sender's digest (healed again)

    @classmethod
    def build(cls, rc, info: DistInfo, secret: bytes | None, sharded: bool = False, tp: int = 1) -> Replicas:
        """From the `replicas` config (mingpt.config.schema.ReplicasConfig) of this process of a group (`info`:
        its place in its torchrun; `sharded`: its processes split the model, trainer.parallel=fsdp or
        `tp` > 1, trainer.tensor_parallel); refused, in one line, where it cannot work."""
        member_view(info)  # one node per group
        procs = info.local_world_size
        if procs % tp:
            raise ReplicaError(f"trainer.tensor_parallel={tp} does not divide a group's {procs} processes: set "
                               f"--nproc_per_node to a multiple of it")
        if secret is None:
            raise ReplicaError("replica groups authenticate each other with the job secret: give every group the "
                               "same MINGPT_JOB_SECRET_FILE (or MINGPT_JOB_SECRET), made once with "
                               "`mingpt-torchrun --new-secret FILE`")
        groups = len(rc.peers)
        shares = model_of(sharded, procs).shares_each(rc.shares_per_group, procs, groups)
        sys.setswitchinterval(SWITCH_S)
        beacon = Beacon(member_addresses(rc.peers, procs), rc.group * procs + info.local_rank, secret, rc.heartbeat_s,
                        rc.lost_after_s, procs, sharded, quorum_wait_s=rc.quorum_wait_s, fan_out=rc.fan_out)
        return cls(beacon, groups * procs, rc.min_groups or default_min_groups(groups), rc.timeout_s, shares, tp)

    @property
    def procs(self) -> int:
        """Processes per group."""
        return self.beacon.procs

    @property
    def groups(self) -> int:
        """Groups in the job (each of `procs` members)."""
        return self.members // self.procs

    @property
    def parts(self) -> int:
        """Into how many parts a share is cut (mingpt/replicas/members.py)."""
        return self.membership.parts

    @property
    def part(self) -> int:
        """This process's part of each share it trains."""
        return self.membership.part

    @property
    def saves(self) -> bool:
        """This process writes snapshots for the job."""
        return self.membership.saves(self.epoch)

    @property
    def me(self) -> str:
        """This member, as the logs name it ("group 1", or "group 1 process 0")."""
        return self.beacon.name(self.beacon.member)

    @property
    def leads(self) -> bool:
        """The epoch's first member: it logs for the job."""
        return self.epoch is not None and self.epoch.rank == 0

    def own(self) -> range:
        """The shares this member's owner (itself, or its whole group) owns: k of them, in a row."""
        k = self.per_group
        me = self.beacon.member // self.membership.unit  # whole groups: a group owns shares (its processes train parts)
        return range(me * k, (me + 1) * k)

    def shares(self) -> list[int]:
        """The shares this member trains: its own, and those of lost owners dealt out in turn (with k
        shares per owner, a lost owner's go one to each of the first k survivors)."""
        k, unit = self.per_group, self.membership.unit
        owners = sorted({m // unit for m in self.epoch.numbers()})  # each member, or each group
        orphans = [s for s in range(self.shares_total) if s // k not in owners]
        return sorted([*self.own(), *orphans[owners.index(self.beacon.member // unit)::len(owners)]])

    def form(self, step: int, should_stop: Callable[[], bool], why: str = "") -> Epoch | None:
        """The next epoch (None: `should_stop`); `why` the last one ended (its root cause: MembershipChanged.cause)."""
        t0 = time.monotonic()
        self._retired = [e for e in self._retired if not e.abandoned.is_completed()]
        if self.epoch is not None and self.epoch.abandoned is not None:
            self._retired.append(self.epoch)
        # (a process of this group lost meanwhile: ReplicaExit, out of the wait)
        self.epoch = self.beacon.form(step, self.live, self.min_groups, self.timeout_s,
                                      lambda: self.check_group() or should_stop(), why)
        self.rejoin_pending = False
        if self.epoch is None:
            return None
        members = self.epoch.numbers() if self.procs == 1 else [f"{m // self.procs}.{m % self.procs}"
                                                                for m in self.epoch.numbers()]
        last = self.epoch.last_request  # (the coordinator's: whom the epoch waited for)
        log.info("replica epoch %d: %s %s (this is %s, rank %d), formed in %.2f s (its links %.2f s%s)",
                 self.epoch.number,
                 "groups" if self.procs == 1 else "group.process", members, self.me, self.epoch.rank,
                 time.monotonic() - t0, self.epoch.setup_s,
                 (f"; the last request, {self.beacon.name(last[0])}'s, came {last[1]:.2f} s in" if last else "")
                 + ("; formed by its beacon before its trainer asked" if self.epoch.ahead else ""))
        return self.epoch

    def check(self) -> None:
        """MembershipChanged if a member of the epoch is lost; ReplicaExit if it is a process of this
        group (its torchrun restarts them all)."""
        if (lost := self.beacon.lost(self.epoch)) is not None:
            self.check_group()
            raise lost

    def check_group(self) -> None:
        """ReplicaExit if a process of this group that was alive is lost: this process leaves at once
        (its torchrun stops it anyway; it must not train on, nor pass the agent's SIGTERM on to the
        others as a preemption)."""
        if self.procs == 1:
            return
        lost = [m for m in self.beacon.siblings(self.beacon.member) if m != self.beacon.member and self.beacon.was_lost(m)]
        if lost:
            raise ReplicaExit(f"{self.beacon.name(lost[0])} was lost: its torchrun restarts the group's processes, "
                              "which rejoin and heal from a live group", code=1)

    def wait(self, work: _InThread) -> object:
        """Wait for a collective of the epoch, giving up when a member is lost (a silent peer would
        otherwise hold it until the process group's timeout): the beacon is asked every LOOK_S. (A
        wait that woke every 0.2 ms to look took 65 ms of CPU a second: on a sixteenth of a core, at 32
        groups, half of a member's share, which the coordinator's beacon then lacked to form an epoch.)"""
        while not work.done.wait(LOOK_S):
            try:
                self.check()
            except MembershipChanged:
                # a member that completed this collective may leave at once (the last step: it exits):
                # its data may be here already; give the collective a moment before dropping the step
                if not work.done.wait(LEAVING_GRACE_S):
                    self.epoch.abandoned = work
                    raise
        try:
            return work.wait()
        except RuntimeError as e:
            # a killed member's gloo connection and its beacon's close together: the beacon names the member
            # and how it was lost, given a moment to read the close; else gloo's first line (which names its
            # source file first: "[.../pair.cc:553] Connection ...")
            deadline = time.monotonic() + self.beacon.heartbeat_s
            while (lost := self.beacon.lost(self.epoch)) is None and time.monotonic() < deadline:
                time.sleep(0.001)
            raise lost or MembershipChanged(re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0])[:160]) from None

    def exchange(self, step: int, rows: dict[tuple[int, ...], torch.Tensor],
                 headers: dict[int, ShareHeader]) -> tuple[torch.Tensor, list[ShareHeader]]:
        """The step's gradient, the same sum whoever trained which share, and every share's header (what
        its trainer sent with it), in share order, with this member's exchange partners
        (`membership.partners`). `rows`: the shares each gradient row carries -> the row: one share, or
        all of one owner's folded in share order (`Rows`).

        The sum is a fixed tree: each owner's subtree, the fold of its k shares in share order, then
        the fold of the subtrees in owner order. A live owner sends its subtree as one row; a lost
        owner's shares arrive one row each, and are folded as the owner would have. The headers are
        gathered by all (a ring); the sum runs along a chain of the members (`_chain`)."""
        epoch, (pg, partners, me) = self.epoch, self.membership.partners(self.epoch)
        # while it runs, this member may end at this step or the next: its beacon asks for no epoch ahead
        # (an epoch asked for at this step, taken at the next, is given up and formed again)
        self.beacon.held = None
        world, k = pg.size(), self.per_group
        per = math.ceil(self.shares_total / world)  # headers per member: the most shares one holds
        table = torch.full((per, ShareRow.WIDTH), -1.0, dtype=torch.float64)  # -1: no share in that row
        key = distributed.derive(self.beacon.secret, "replicas-exchange").encode()
        held = sorted((share, i) for i, shares in enumerate(rows) for share in shares)
        for j, (share, i) in enumerate(held):  # each share's header names the gradient row that carries it
            table[j] = ShareRow(share, step, epoch.number, i, headers[share]).pack(key)
        everyone = self.wait(_InThread(lambda: ring_gather(pg, me, world, table, self._TAG_HEADERS))).view(-1, ShareRow.WIDTH)
        carried: dict[tuple[int, int], list[int]] = {}  # (sender, its gradient row) -> the shares in it
        every: dict[int, ShareHeader] = {}
        for i, t in enumerate(everyone):
            try:
                row = ShareRow.unpack(t, key)
            except WireError:
                raise MembershipChanged(f"a header of the exchange of step {step} does not carry the job's MAC") from None
            if row is None:
                continue
            if (row.step != step or row.epoch != epoch.number or row.share in every
                    or not 0 <= row.share < self.shares_total or not 0 <= row.row < per):
                raise MembershipChanged(f"the exchange of step {step} does not add up (row {list(row[:4])})")
            carried.setdefault((i // per, row.row), []).append(row.share)
            # the group that trained it is its sender's, as the ring knows it, not as the row says: a stop
            # signal in a header takes that group out of the job
            every[row.share] = row.header._replace(group=float(partners[i // per].number // self.procs))
        if sorted(every) != list(range(self.shares_total)):
            raise MembershipChanged(f"the exchange of step {step} lacks shares {set(range(self.shares_total)) - set(every)}")
        subtree: dict[int, tuple[int, int]] = {}  # owner -> (its sender, the row) of its whole subtree
        single: dict[int, tuple[int, int]] = {}  # share -> (its sender, the row): a lost owner's
        for (sender, r), shares in carried.items():
            owner = shares[0] // k
            if sorted(shares) == list(range(owner * k, owner * k + k)):
                subtree[owner] = (sender, r)
            elif len(shares) == 1:
                single[shares[0]] = (sender, r)
            else:
                raise MembershipChanged(f"the exchange of step {step} does not add up (a row carries shares {sorted(shares)})")
        total = self.wait(_InThread(lambda: self._chain(pg, me, world, list(rows.values()), subtree, single, k)))
        epoch.exchanged = True
        self._live_at(step + 1)  # (the step is applied; one dropped after all is formed anew: Beacon._take_ahead)
        return total, [every[s] for s in range(self.shares_total)]

    def _chain(self, pg, me: int, world: int, mine: list[torch.Tensor], subtree: dict, single: dict,
               k: int) -> torch.Tensor:
        """The fold of every owner's subtree in owner order, passed along a chain of the members: each
        adds the subtrees it places (its own, then those of the lost owners after it, whose shares it
        receives and folds in share order as the owner would have) to the running sum it receives and
        passes it on, a chunk at a time; the last one's sum goes round the ring to the others. Each
        member talks to its two neighbours in rank order, and to a lost owner's trainers when it
        places its subtree: only those pairs are made (`Ring.connect`), and each member sends and
        receives the gradient about twice whatever the number of members."""
        place: dict[int, int] = {}  # owner -> the member that adds its subtree to the running sum
        for o in sorted({*subtree, *(s // k for s in single)}):  # a lost owner's: the one placing the owner before
            place[o] = subtree[o][0] if o in subtree else place.get(o - 1, single[o * k][0])
        segments: list[tuple[int, list[int]]] = []  # (member, the owners it adds), in owner order
        for o, p in place.items():
            if segments and segments[-1][0] == p:
                segments[-1][1].append(o)
            else:
                segments.append((p, [o]))
        talks = set(pg.neighbours())  # the pairs this member needs, made first (their other ends make them too)
        for i, (p, _) in enumerate(segments):
            if p == me:
                talks |= {segments[j][0] for j in (i - 1, i + 1) if 0 <= j < len(segments)}
        for share, (sender, _) in single.items():
            talks |= {place[share // k]} if sender == me else {sender} if place[share // k] == me else set()
        pg.connect(talks - {me})
        n, dtype = mine[0].numel(), mine[0].dtype
        pending: list = []  # sends in flight
        gathered: dict[int, torch.Tensor] = {}  # the shares of the lost owners this member places
        recvs = []
        for share, (sender, r) in sorted(single.items()):
            to = place[share // k]
            if to == me:
                gathered[share] = mine[r] if sender == me else torch.empty(n, dtype=dtype)
                if sender != me:
                    recvs.append(pg.recv(gathered[share], sender, self._TAG_SHARE + share))
            elif sender == me:
                pending.append(pg.send(mine[r], to, self._TAG_SHARE + share))
        for work in recvs:
            work.wait()
        parts: dict[int, list[torch.Tensor]] = {}  # this member's segments -> what it adds, in owner order
        for i, (p, owners) in enumerate(segments):
            if p != me:
                continue
            parts[i] = []
            for o in owners:
                if o in subtree:
                    parts[i].append(mine[subtree[o][1]])
                else:  # a lost owner's: its shares folded in share order, as it would have
                    part = gathered[o * k].clone()
                    for share in range(o * k + 1, o * k + k):
                        part += gathered[share]
                    parts[i].append(part)
        total = torch.empty(n, dtype=dtype)
        chunks = list(range(0, n, self.CHUNK))
        for c, lo in enumerate(chunks):  # the running sum, a chunk at a time
            part = total[lo:lo + self.CHUNK]
            for i, adds in parts.items():
                tag = self._TAG_SUM + c * len(segments) + i
                if i == 0:
                    part.copy_(adds[0][lo:lo + self.CHUNK])
                else:
                    pg.recv(part, segments[i - 1][0], tag).wait()
                for add in adds[1:] if i == 0 else adds:
                    part += add[lo:lo + self.CHUNK]
                if i + 1 < len(segments):
                    pending.append(pg.send(part, segments[i + 1][0], tag + 1))
        for work in pending:
            work.wait()
        ring_broadcast(pg, me, world, total, segments[-1][0], self._TAG_TOTAL, self.CHUNK)  # the sum, from the
        return total  # chain's last member

    def heal(self, slots: list, state: Callable[[], dict], load: Callable[[dict], None]) -> Healed:
        """Bring every member to the newest state among them: the first member holding it broadcasts
        its tensors and JSON state (a broadcast reaches every member behind in one collective); a
        receiver keeps what it received only if it matches the sender's digest."""
        pg, members, me = self.membership.partners(self.epoch)  # whole groups: each shard from its holders
        best = max(members, key=lambda m: (m.live, m.step))
        source = members.index(best)
        behind = [i for i, m in enumerate(members)
                  if i != source and ((m.step, m.live) != (best.step, best.live) or (best.live and not m.live))]
        healed = Healed(best.number, self.membership.healed([members[i].number for i in behind]))
        if not behind:
            self._live_at(best.step)
            return Healed(None, [])
        key = distributed.derive(self.beacon.secret, "replicas-heal").encode()  # a digest only the job can make
        meta = state() if me == source else {}
        if me == source:  # one tag per receiver, bound to this epoch and sender
            digest = state_digest(key, slots, meta)
            meta["digest"] = {str(members[i].number): heal_tag(key, digest, self.epoch.number, best.number,
                                                               members[i].number) for i in behind}
        blob = json.dumps(meta).encode() if me == source else b""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        self._broadcast(pg, me, size, source)
        if not 0 <= int(size) <= MAX_STATE_JSON:
            raise MembershipChanged(f"the state from {self.beacon.name(best.number)} announced {int(size)} bytes of JSON")
        blob_t = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if me == source
                  else torch.empty(int(size), dtype=torch.uint8))
        self._broadcast(pg, me, blob_t, source)
        received = self._broadcast_slots(pg, me, slots, source)
        if me == source or me not in behind:  # up to date: what it received is what it holds
            self._live_at(best.step)
            return healed
        meta, tags = unpack_state(blob_t)
        tag = tags.get(str(members[me].number)) if isinstance(tags, dict) else None
        if not isinstance(tag, str) or not hmac.compare_digest(heal_tag(
                key, state_digest(key, slots, meta, received), self.epoch.number, best.number, members[me].number), tag):
            # nothing was loaded: this member stays as it was (not live), and heals again in the next epoch
            self.failed_heals += 1
            raise MembershipChanged(f"the state received from {self.beacon.name(best.number)} does not match its digest "
                                    f"(heal failed {self.failed_heals} time(s); healing again)")
        with torch.no_grad():
            for slot, t in zip(slots, received):
                slot.local.copy_(t)
        load(meta)
        self._live_at(best.step)
        return healed

    def _live_at(self, step: int) -> None:
        """This member holds the job's state at `step` (its beacon takes the next epoch with it while its
        trainer finishes a dropped step: Beacon._form_ahead)."""
        self.live = True
        self.beacon.held = (self.epoch.number, step)

    def _broadcast_slots(self, pg, me: int, slots: list, source: int) -> list:
        """The slots' tensors from rank `source` (this member `me`), on the host (over the epoch's ring; a
        GPU's tensors are copied to and from it), packed into buffers: one broadcast per buffer,
        not per tensor (a collective's latency times a few hundred tensors). A receiver's are views into
        the buffers; the sender's list is empty."""
        sends = me == source
        received: list = [None] * len(slots) if not sends else []
        for size, packed in buckets([slot.local for slot in slots]):
            buf = torch.empty(size, dtype=torch.uint8)
            for i, offset in packed:
                t = slots[i].local
                part = buf[offset:offset + t.numel() * t.element_size()]
                if sends:
                    part.copy_(byte_view(t.detach().contiguous()))
                else:
                    received[i] = part.view(t.dtype).view(t.shape)
            self._broadcast(pg, me, buf, source)
        return received

    def _broadcast(self, pg, me: int, t: torch.Tensor, source: int) -> None:
        """`t` from rank `source` to every member, round the epoch's ring (a member lost meanwhile: noticed)."""
        def chain():
            pg.connect(pg.neighbours())
            ring_broadcast(pg, me, pg.size(), t, source, self._TAG_HEAL, self.CHUNK)
        self.wait(_InThread(chain))

    def reduce(self, model: torch.nn.Module, rows: Rows, step: int, preempted: bool, timed: bool,
               compute_s: float = 0.0) -> float:
        """The step's gradient into `model`: every share's (`rows`: this member's, with each share's
        summed token loss and micro-batches), summed by the exchange's fixed tree; this member's flags
        (a preemption signal, the save interval elapsed, a group waiting to join) are agreed by the same
        exchange, and its seconds computing its shares (`compute_s`) told to all. Returns the step's
        summed token loss. A sync: the exchange runs on the host."""
        if preempted and self.procs > 1:  # the agent's SIGTERM after a process of this group died is no preemption
            time.sleep(2 * self.beacon.heartbeat_s)  # (the dead process's connection closed first: give it time)
            self.check_group()
        joiners = float(bool(self.beacon.joiners(self.epoch)))
        heads = {share: ShareHeader(float(preempted), float(timed), joiners, float(loss.item()),
                                    float(sum(len(mb) for mb in mbs)), float(sum(int(mb.sum()) for mb in mbs)),
                                    float(self.beacon.member // self.procs), float(compute_s))
                 for share, (loss, mbs) in rows.meta.items()}
        failed = total = None
        try:
            total, every = self.exchange(step, rows.rows(), heads)
        except MembershipChanged as e:  # (whole groups: the group's processes vote on it first)
            failed, every = e, []
        every = self.membership.agree(step, failed, every, self.shares_total, next(model.parameters()).device)
        set_grads(model, total)
        # a stop signal stops the group it reached (a node handed back, a spot instance reclaimed), not the job:
        # it leaves after this step, the others form an epoch without it at once (not waiting to hear it
        # gone), and the epoch's saver saves this step (where every group is stopped, one at a time, the
        # last snapshot is the last step any of them trained)
        leaving, mine = {int(h.group) for h in every if h.preempted}, self.beacon.member // self.procs
        self.leaving = sorted(leaving - {mine})
        self.staying = len(self.epoch.groups(self.procs) - leaving)  # groups that train on
        self.flags = (mine in leaving, any(h.timed for h in every) or bool(leaving))
        self.rejoin_pending = any(h.joiners for h in every) or bool(self.leaving)
        if self.leaving:  # (not every step: news to the beacon wakes its waiters and its judge)
            self.beacon.leave(self.epoch, self.leaving)
        self.shares_record = [[int(h.group), int(h.samples), int(h.ids)] for h in every]
        by_group: dict[int, float] = {}
        for h in every:
            by_group[int(h.group)] = max(by_group.get(int(h.group), 0.0), h.compute)
        self.group_compute = [[g, round(1000 * s, 2)] for g, s in sorted(by_group.items())]
        return sum(h.loss for h in every)

    def finish(self) -> None:
        """After the last step (and the leader's final commit): say so, and wait until every other member of
        the epoch has finished too (or left it, or is lost), at most `timeout_s`. A member that exited
        while another was still in the last exchange looked lost to it: that step was dropped there, and a
        process of the same group restarted its group, only to find the run finished."""
        self.beacon.set_status(state="finished")
        deadline = time.monotonic() + self.timeout_s
        while self.epoch is not None and self.beacon.unfinished(self.epoch) and time.monotonic() < deadline:
            time.sleep(self.beacon.heartbeat_s / 2)
        time.sleep(2 * self.beacon.heartbeat_s)  # the others hear this one finished before its connections close

    def close(self) -> None:
        self.beacon.close()


def default_min_groups(groups: int) -> int:
    """A majority: two sides of a cut network can never both train."""
    return groups // 2 + 1
