"""The beacon of a replica group: heartbeats, join requests, and the epochs their coordinator (the
lowest member alive) forms. A member hears only a few others directly (link.py: the two lowest
members up, its epoch's coordinator and successor, its own group's processes); the coordinator, which
every member dials, hears all of them and tells each member its verdict on their epoch in its
heartbeats. See mingpt/replicas/__init__.py."""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from mingpt.replicas.link import Links, ReplicaError, host_port
from mingpt.replicas.ring import Ring
from mingpt.replicas.wire import Channel, EpochNews, Heartbeat, Join, Member, Wait, counts_in, encode
from mingpt.runtime.trust import bound_store

log = logging.getLogger(__name__)

SLACK_HALF_LIFE_S = 60.0  # how fast a member's late heartbeats are forgotten (Beacon._patience)
STORE_TIMEOUT_S = 600.0  # a rendezvous store's own limit on one request (a pair's wait has the epoch's: Ring)
SAY_WAITING_S = 10.0  # a member forming this long without an epoch says what it waits for (and again after as long)


class MembershipChanged(Exception):
    """A member was lost (or left) during a step: the step in flight is dropped. `cause`: the root cause,
    which the heartbeats tell the others (where a member left for a cause it saw: that cause)."""

    def __init__(self, why: str, cause: str = ""):
        super().__init__(why)
        self.cause = cause or why


@dataclass
class Epoch:
    number: int
    members: list[Member]  # in rank order (by member number)
    rank: int
    key: str = ""  # its coordinator's draw: the names its links meet under (EpochNews.key)
    pg: Ring | None = None  # the epoch's members, linked round a ring (ring.py)
    shard_pg: Ring | None = None  # sharded groups: the ring of the members holding this one's shard
    since: float = field(default_factory=time.monotonic)  # when this member learned of it
    setup_s: float = 0.0  # how long making its links took here
    last_request: tuple[int, float] | None = None  # its coordinator's: the member whose request came last, and
    # how long after the coordinator began to form it
    abandoned: object = None  # a collective of it left unfinished here (a member was lost meanwhile): its work
    exchanged: bool = False  # a step's exchange completed in it here
    ahead: bool = False  # this member's beacon took it while its trainer finished a step (Beacon._form_ahead)

    @property
    def world(self) -> int:
        return len(self.members)

    def numbers(self) -> list[int]:
        """The members' numbers, in rank order."""
        return [m.number for m in self.members]

    def groups(self, procs: int) -> set[int]:
        """The groups of its members (groups of `procs` processes)."""
        return {m.number // procs for m in self.members}

    def holders(self, member: int, procs: int) -> list[Member]:
        """The members that hold `member`'s shard in sharded groups of `procs` processes: the same
        process of every group."""
        return [m for m in self.members if m.number % procs == member % procs]


class Beacon:
    """This member's view of the job: who is alive (heartbeats), who trains in which epoch, and the
    coordinator's forming of epochs, over its links to a few other members (`links`: link.py). The
    coordinator of an epoch judges it for all (`lost`), from every member's heartbeats; a member
    judges its coordinator (and its own group's processes) itself, and takes the coordinator's verdict for the rest."""

    def __init__(self, addresses: list[str], member: int, secret: bytes, heartbeat_s: float, lost_after_s: float,
                 procs: int = 1, sharded: bool = False, quorum_wait_s: float = 600.0, fan_out: int = 0):
        # with several processes per group (`procs`), each process is a member: `addresses` lists every
        # member's and `member` is this process's place in it (group * procs + process);
        # `sharded`: the group's processes shard the model (FSDP), and each epoch also gets a process
        # group per process index (the members that hold the same shard); `fan_out`: a job of more members than
        # fan_out + 1 hears its members through a tree of relays (link.py), each with fan_out members below it
        self.member, self.secret, self.procs, self.members = member, secret, procs, len(addresses)
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self.quorum_wait_s = quorum_wait_s  # forming ends when too few groups are heard from at all for this long
        self.sharded = sharded and procs > 1
        self.incarnation = secrets.token_hex(6)
        self._since: float | None = None  # since when this member is the lowest alive (a new coordinator):
        # it waits for members it has never heard from for lost_after_s from then
        self.status = Heartbeat("starting", -1, 0, -1)  # then forming, training, finished: sent as it is
        self.max_epoch = -1
        self.last: Epoch | None = None  # the last epoch this member trained in: the coordinator's own record
        self._lock = threading.Lock()
        self._seen: dict[int, dict] = {}  # member -> its last heartbeat (with "inc", "t" and "eof")
        self._requests: dict[int, tuple[Join, str, Channel]] = {}  # join requests to the coordinator: (request, inc, channel)
        self._asked_at: dict[int, float] = {}  # when each member's pending join request first came
        self._pending: set[str] = set()  # ids of our join requests not yet answered
        self._replies: dict[str, EpochNews | Wait] = {}  # their answers, by request id
        self._announced: EpochNews | None = None  # the epoch this coordinator announced, until it leaves it: a
        # member of it whose answer was lost asks again, and is answered with it (`_heard`)
        self._announced_at = 0.0  # (a tree) when it last went down to every member
        self._told_claims: set[int] = set()  # members whose claims the record contradicted, named once
        self._left: dict[int, str] = {}  # members a stop signal took out of the job -> their incarnation: not alive
        # to this one, whatever they still beat (the same process back, or a new one, is alive again)
        self._invited: EpochNews | None = None  # an epoch that counts this member in, answering a request it gave up on
        # news of a member (heard from anew, or a channel to it up): a member forming an epoch looks again
        self._news = threading.Condition()
        self._news_n = 0  # news told so far: a waiter waits for more than it saw (`_await_news`)
        self._quiet: tuple = (None, -1, 0.0)  # `lost` said None for (epoch, news) and will until then
        self.held: tuple[int, int] | None = None  # (epoch, step): this member holds the job's state at that step,
        # trained in that epoch (its Replicas says, after a heal and after each exchange; None while an exchange runs)
        self._forming: tuple[int, float] | None = None  # form()'s (min_groups, timeout_s), for forming ahead
        self._rendezvous: dist.TCPStore | None = None  # this member's store, where the pairs of its links that it
        # is the lower end of meet (made at its first forming, kept for its life: Member.store)
        self._ahead: dict | None = None  # the next epoch this beacon takes while its trainer finishes the
        # step the last one dropped (`_form_ahead`)
        self.links = Links([host_port(a) for a in addresses], member, self.incarnation, secret, heartbeat_s,
                           lost_after_s, procs, heartbeat=self._beat, on_message=self._heard,
                           on_up=lambda _: self._tell(), on_lost=self._hung_up, pins=self._pins, fan_out=fan_out)
        self.name = self.links.name  # a member as the logs name it: "group 2", or "group 2 process 1"
        self.links.start()

    def close(self) -> None:
        self.links.close()

    # --- what the trainer asks -------------------------------------------------------------------

    def was_lost(self, member: int) -> bool:
        """Whether `member` was heard from and is lost now (its connection broke, or it went silent)."""
        with self._lock:
            s = self._seen.get(member)
            return s is not None and (s["eof"] or time.monotonic() - s["t"] >= self._patience(s))

    def _patience(self, seen: dict, at_least: float = 0.0) -> float:
        """How long a member may be silent before it is lost: lost_after_s, or where its heartbeats have
        been coming late (a starved process, on a loaded node; or this one, slow to read them) twice
        their longest recent gap, up to 4 x lost_after_s. Slow is not lost: a member whose heartbeats
        come every second on 1/16 of a core was lost at every pause, and each new epoch starved it more.
        A killed one is known at once (its connections close); a frozen one within the same patience."""
        return max(at_least, min(4 * self.lost_after_s, max(self.lost_after_s, 2 * seen.get("slack", 0.0))))

    def leave(self, epoch: Epoch, groups: list[int]) -> None:
        """The members of `groups` leave the job after this step of `epoch` (a stop signal, told in its
        exchange): not waited for, not let in, not coordinating, until a new process of theirs is heard."""
        with self._lock:
            self._left.update({m.number: m.incarnation for m in epoch.members if m.number // self.procs in groups})
        self._tell()

    def siblings(self, member: int) -> range:
        """The members of `member`'s group (itself included)."""
        first = member - member % self.procs
        return range(first, first + self.procs)

    def broken(self) -> set[int]:
        """Members whose group lost a process: they leave with it (its torchrun restarts them all). (One look at
        the members heard: a look at each member's group, each under the lock, took the coordinator of 1,024
        members 10 ms, at each news while it formed.)"""
        now = time.monotonic()
        with self._lock:
            lost = [m for m, s in self._seen.items() if s["eof"] or now - s["t"] >= self._patience(s)]
        return {m for lost_one in lost for m in self.siblings(lost_one)}

    def alive(self, at_least: float = 0.0) -> dict[int, str]:
        """{member: incarnation} of every member heard from within its patience (lost_after_s, or longer:
        `_patience`; `at_least` this), this one included."""
        with self._lock:
            return self._alive(at_least)

    def _alive(self, at_least: float = 0.0) -> dict[int, str]:
        now = time.monotonic()
        out = {m: s["inc"] for m, s in self._seen.items() if self._heard_in_time(m, s, now, at_least)}
        out[self.member] = self.incarnation
        return out

    def _heard_in_time(self, member: int, seen: dict | None, now: float, at_least: float = 0.0) -> bool:
        return (seen is not None and not seen["eof"] and now - seen["t"] < self._patience(seen, at_least)
                and self._left.get(member) != seen["inc"])

    def _lower_alive(self) -> bool:
        """Whether a member below this one is alive (`_alive`'s, without a look at every member: the root of
        512 spent a third of its time on it, a join request each)."""
        now = time.monotonic()
        return any(self._heard_in_time(m, self._seen.get(m), now) for m in range(self.member))

    def _silent_at(self, member: int) -> float:
        """When `member`, heard alive now, is lost if it is not heard again (time.monotonic())."""
        with self._lock:
            s = self._seen.get(member)
            return float("inf") if member == self.member or s is None else s["t"] + self._patience(s)

    def lost(self, epoch: Epoch, at_least: float = 0.0) -> MembershipChanged | None:
        """Why `epoch` cannot go on (a member lost or gone to form another), or None. Its coordinator judges
        every member; another member its coordinator and its group's processes, then takes the coordinator's verdict.
        `at_least`: a silent member is lost only after this long (while the epoch's group is made).

        Asked every millisecond during a collective: a None stands until a member's news or until the
        first of them could fall silent (the coordinator looked at every member each time: at 32 groups,
        60 us a look, its whole sixteenth of a core)."""
        key, news, now = (epoch.number, epoch.since, at_least), self._news_n, time.monotonic()
        if self._quiet[:2] == (key, news) and now < self._quiet[2]:
            return None
        verdict = self._judge(epoch, at_least)
        if verdict is None:
            with self._lock:
                until = [s["t"] + self._patience(s, self._taking(epoch, s, at_least)) for m in epoch.members
                         if (s := self._seen.get(m.number)) is not None and not s["eof"]]
            if now < epoch.since + self.lost_after_s:  # (one not heard from yet is vouched for until then)
                until.append(epoch.since + self.lost_after_s)
            self._quiet = (key, news, min(until, default=now))
        return verdict

    def _taking(self, epoch: Epoch, seen: dict, at_least: float) -> float:
        """`at_least` for a member of `epoch` (`seen`: its last heartbeat): until it is heard training
        in it, as long a silence as any (4 x lost_after_s). Taking an epoch is a loaded node's busiest
        moment (its first exchange connects it to its neighbours; at 32 groups on 2 cores a member fell
        silent for seconds): slow is not lost, and dropping it would only start another epoch to be slow in."""
        taken = seen.get("epoch") == epoch.number and seen.get("state") in ("training", "finished")
        return at_least if taken else max(at_least, 4 * self.lost_after_s)

    def _judge(self, epoch: Epoch, at_least: float) -> MembershipChanged | None:
        alive, taking = self.alive(at_least), self.alive(max(at_least, 4 * self.lost_after_s))
        coordinator = epoch.members[0].number
        with self._lock:
            seen = {m.number: dict(self._seen[m.number]) for m in epoch.members if m.number in self._seen}
        # (the coordinator judges every member; another member only its coordinator and its own group's
        # processes, and takes the coordinator's verdict for the rest: the successor too, which it hears
        # but which, hearing every member on a loaded node, beats late to some of them now and then: at
        # 32 groups one of thirty members judging it by its own clock ended the epoch where the coordinator
        # heard it in time, twice in a run)
        direct = None if coordinator == self.member else {coordinator} | set(self.siblings(self.member))
        if (direct is None and not epoch.exchanged and (lower := min(alive)) < self.member
                and any(seen.get(m.number, {}).get("taking") != epoch.number for m in epoch.members[1:])):
            # a lower member is back (a spare took a killed coordinator's place) while a member of this epoch is
            # not heard taking it: it coordinates, and that member, asking it instead, may be in its epoch of
            # the same number, which then looks as if in this one (it waited 10 s for one it had asked, here).
            # Once every member takes this one, none asks the lower member (which waits for their requests, this
            # one's too): the step in flight is trained, and it joins at the next, as any returning member does
            return MembershipChanged(f"{self.name(lower)} is up again: it coordinates")
        others = [m for m in epoch.members if m.number != self.member and (direct is None or m.number in direct)]
        for m in others:  # a lost member first: it is the cause, the others leaving only follow it
            # one not heard from yet (this member just started: a spare that took its place) is vouched
            # for by the coordinator that asked it in, until it has been silent as long as a member taking
            # an epoch may be, from the epoch's start; so, for a member that is not the coordinator, is one
            # heard only before the epoch (a loaded node answers the members that dial it in turn)
            heard = seen.get(m.number, {})
            last_heard = (heard["t"] if direct is not None else float("inf")) if heard else 0.0
            floor = self._taking(epoch, heard, at_least)
            window = self._patience(heard, floor)
            hung_up = heard.get("eof_t", -1.0) >= epoch.since  # (gone since the epoch began)
            unheard = last_heard < epoch.since and time.monotonic() - epoch.since < window and not hung_up
            if (taking if floor > at_least else alive).get(m.number) != m.incarnation and not unheard:
                how = ("it left the job: a stop signal" if self._left.get(m.number) == m.incarnation
                       else self._how_lost(seen.get(m.number), m.incarnation, floor))
                return MembershipChanged(f"{self.name(m.number)} lost ({how})")
        for m in others:
            s = seen.get(m.number, {})
            if s.get("state") == "finished" and s.get("epoch") == epoch.number:
                continue  # it applied the last step, and stays until every member has (`unfinished`)
            if (s.get("epoch") != epoch.number or s.get("state") != "training") and s.get("epoch", -1) >= epoch.number:
                # (a heartbeat of the previous epoch may be late); it left for the cause it saw first
                return MembershipChanged(f"{self.name(m.number)} left epoch {epoch.number}"
                                         + (f" ({s['why']})" if s.get("why") else ""), s.get("why", ""))
        verdict = seen.get(coordinator, {})
        if direct is not None and verdict.get("epoch") == epoch.number and verdict.get("ended"):
            return MembershipChanged(verdict["ended"], verdict["cause"])
        return None

    def _direct(self, epoch: Epoch) -> set[int]:
        """The members of `epoch` this one keeps channels to: its coordinator and successor (which takes over
        if the coordinator is lost), its own group's processes."""
        return {m.number for m in epoch.members[:2]} | set(self.siblings(self.member))

    def _how_lost(self, seen: dict | None, incarnation: str, at_least: float = 0.0) -> str:
        """How a member of an epoch was lost, from its last heartbeat as this beacon saw it (`seen`)."""
        if seen is None:
            return f"never heard from in {round(self._patience({}, at_least), 1):g} s"
        if seen["inc"] != incarnation and not seen["eof"]:
            return "it restarted: a new process in its place"
        if seen["eof"]:
            return "its connection closed"
        return f"not heard from in {round(self._patience(seen, at_least), 1):g} s"

    def unfinished(self, epoch: Epoch) -> list[int]:
        """Members still training in `epoch`: not finished, not gone to form another, not lost. Its
        coordinator's verdict for a member that does not hear them all: the coordinator, until it says
        every member has finished."""
        coordinator = epoch.members[0].number
        with self._lock:
            seen = {m: dict(s) for m, s in self._seen.items()}
        if coordinator != self.member:
            s = seen.get(coordinator, {})
            return [] if self.was_lost(coordinator) or (s.get("done") and s.get("epoch") == epoch.number) else [coordinator]
        return [m.number for m in epoch.members if m.number != self.member and not self.was_lost(m.number)
                and seen.get(m.number, {}).get("state") == "training" and seen[m.number].get("epoch") == epoch.number]

    def joiners(self, epoch: Epoch) -> list[int]:
        """Members alive that are not members of `epoch` (a restarted group, a healed partition), once
        their whole group is ready: a group's processes join together, in one new epoch. Its coordinator's
        to say, which hears every member (the exchange tells the others): another member hears a few, and
        counted a group of two whole while its SIGKILLed process was lost to the coordinator (while the other
        lingered, 0.8 s, a new epoch formed at every step, without the group)."""
        if epoch.members[0].number != self.member:
            return []
        mine = {m.number: m.incarnation for m in epoch.members}
        alive = self.alive()
        with self._lock:
            starting = {m for m, s in self._seen.items() if s.get("state") == "starting"}
        ready = {m for m, inc in alive.items() if mine.get(m) != inc and m not in starting}
        return sorted(m for m in ready
                      if all(s in ready or (s in alive and mine.get(s) == alive[s]) for s in self.siblings(m)))

    def set_status(self, **kw) -> None:
        with self._lock:
            self.status = replace(self.status, **kw)
            if "epoch" in kw:
                self.max_epoch = max(self.max_epoch, kw["epoch"])
        self.links.wake()  # the members that hear this one hear it now

    def _beat(self) -> Heartbeat:
        """This member's heartbeat; the coordinator of an epoch adds its verdict on it, for the members
        that do not hear every other: why it cannot go on, whether every member finished."""
        status, last, alive = self.status, self.last, self.alive()
        groups = self._groups_alive(alive)
        self._form_ahead(status, last, min(alive))
        if last is None or last.members[0].number != self.member or status.epoch != last.number:
            return replace(status, groups=groups)
        ended = self.lost(last) if status.state in ("training", "finished") else None
        done = status.state == "finished" and not self.unfinished(last)
        return replace(status, ended=str(ended or "")[:300], cause=(ended.cause if ended else "")[:300], done=done,
                       groups=groups)

    def _pins(self) -> set[int]:
        """The members this one keeps a channel to beside the lowest ones up: its group's processes, and
        while it trains in an epoch, the epoch's coordinator and successor (whose verdict it takes)."""
        last = self.last
        if last is not None and self.status.state in ("training", "finished") and not self.links.tree:
            return self._direct(last) - {self.member}
        return set(self.siblings(self.member)) - {self.member}

    # --- forming an epoch -------------------------------------------------------------------------
    def form(self, step: int, live: bool, min_groups: int, timeout_s: float,
             should_stop: Callable[[], bool], why: str = "") -> Epoch | None:
        """Join the next epoch: ask the coordinator (the lowest member alive) until it forms one that
        holds at least `min_groups` groups; then make the epoch's process group. None: `should_stop`.
        `why` the last epoch ended (its root cause: MembershipChanged.cause), told to the others in the heartbeats."""
        with self._lock:  # (under the lock: a beacon takes an epoch ahead only while its trainer trains)
            self._forming, ahead = (min_groups, timeout_s), self._ahead
            if ahead is None:
                self.status = replace(self.status, state="forming", step=step, why=why[:300])
        if ahead is not None:
            epoch = self._take_ahead(ahead, step, live, should_stop)
            with self._lock:
                self._ahead = None
                if epoch is None:
                    self.status = replace(self.status, state="forming", step=step, why=why[:300])
            if epoch is not None:
                return epoch
        self.links.wake()
        waited = heard = time.monotonic()  # heard: when a quorum of groups was last heard from (starting too)
        while True:
            seen = self._news_n
            if should_stop():
                return None
            coordinator = min(self.alive())
            if coordinator != self.member:
                self._since = None
            elif self._since is None:
                self._since = time.monotonic()
            if self._groups_heard(coordinator) >= min_groups:
                heard = time.monotonic()
            elif time.monotonic() - heard > self.quorum_wait_s:  # the missing groups exited (or never started)
                missing = sorted(set(range(self.members // self.procs)) - {m // self.procs for m in self.alive()})
                # (the coordinator hears every member: it names them; another member counts them)
                which = (f"groups {missing}" if coordinator == self.member else
                         f"{self.members // self.procs - self._groups_heard(coordinator)} groups")
                raise ReplicaError(f"replica {self.name(self.member)} heard from too few groups for a quorum of "
                                   f"{min_groups} in {self.quorum_wait_s:g} s (replicas.quorum_wait_s): {which} "
                                   "exited or never started (see their logs); start them again, then this group "
                                   "with them")
            try:
                epoch = self._request(coordinator, step, live, min_groups)
            except OSError:
                epoch = None
            if epoch is not None:
                if self._take(epoch, timeout_s):
                    return epoch
                continue
            if time.monotonic() - waited > SAY_WAITING_S:
                # (the coordinator names the groups it hears; another member hears a few, and counts the coordinator's)
                groups = self._groups_heard(coordinator)
                said = (f"alive: {sorted({g // self.procs for g in self.alive()})}" if coordinator == self.member else
                        f"{groups} alive, as {self.name(coordinator)} hears them")
                if coordinator != self.member and groups >= min_groups:
                    # (a quorum is up: what it waits for is the coordinator's answer, not more groups)
                    log.warning("replica %s waits for %s, the coordinator, to let it into an epoch (%s)",
                                self.name(self.member), self.name(coordinator), said)
                else:
                    log.warning("replica %s waits for a quorum of %d groups (%s)", self.name(self.member), min_groups, said)
                waited = time.monotonic()
            self._await_news(seen, self.heartbeat_s)

    def _take(self, epoch: Epoch, timeout_s: float, **status) -> bool:
        """Make `epoch`'s group and train in it (True); or, a member lost meanwhile, say in the heartbeats
        that this member left it (False): the others may have made the epoch's group (its thread here may
        still finish it) and must not wait in it for this member. `status`: more of this member's status."""
        self.set_status(taking=epoch.number, **status)
        try:
            self._make_group(epoch, timeout_s)
        except MembershipChanged as e:
            log.warning("epoch %d did not form (%s); trying again", epoch.number, e)
            with self._lock:
                self._announced = None
            self.set_status(state="forming", epoch=epoch.number, why=str(e)[:300])
            return False
        self.last = epoch  # (before the status: `_beat` judges `last` once the status names it)
        self.set_status(state="training", epoch=epoch.number)
        with self._lock:
            self._invited = None
        return True

    def _form_ahead(self, status: Heartbeat, last: Epoch | None, lowest: int) -> None:
        """Every member's beacon takes the next epoch in a thread of its own as soon as its last one has
        ended, while its trainer finishes the share in flight (kept for the step's redo): the lowest
        member alive forms it, the others ask it, and each makes its links. So the epoch forms while
        the shares are finished, not after the slowest of them: at 32 groups on 2 cores the others all
        asked within 0.3 s of a kill, then waited up to 2 s for the coordinator (hearing every member
        makes it the slowest) to finish its share and form; and the last request came when the slowest
        member had finished its share. Its trainer takes the epoch when it asks (`_take_ahead`). One
        process per group only (a group's processes decide together in the exchange whether a step was
        dropped)."""
        if (self.procs > 1 or self._forming is None or last is None or status.state != "training"
                or status.epoch != last.number or self.held is None or self.held[0] != last.number
                or self._ahead is not None):
            return
        if (ended := self.lost(last)) is None:
            return
        with self._lock:  # (its trainer may be forming already: then it forms)
            if self.status.state != "training" or self._ahead is not None:
                return
            ahead = self._ahead = {"step": self.held[1], "done": threading.Event()}
            if lowest == self.member:
                self._since = self._since or time.monotonic()
        threading.Thread(target=self._run_ahead, args=(ahead, ended.cause), daemon=True).start()

    def _run_ahead(self, ahead: dict, why: str) -> None:
        min_groups, timeout_s = self._forming
        try:
            epoch = self._request(min(self.alive()), ahead["step"], True, min_groups)
            if epoch is not None:
                epoch.ahead = True
                if self._take(epoch, timeout_s, why=why[:300], step=ahead["step"]):
                    ahead["epoch"] = epoch
        except OSError:  # (as in form(): its trainer forms)
            pass
        finally:
            ahead["done"].set()

    def _take_ahead(self, ahead: dict, step: int, live: bool, should_stop: Callable[[], bool]) -> Epoch | None:
        """The epoch this member's beacon formed ahead (`_form_ahead`), once made, if this member's trainer
        is where the beacon took it to be (a member at `step`, `live`); else None, and it forms anew."""
        while not ahead["done"].wait(0.05):
            if should_stop():
                return None
        epoch = ahead.get("epoch")
        if epoch is None or (step, live) == (ahead["step"], True):
            return epoch
        log.warning("epoch %d was formed for this member at step %d, where it is at step %d (%s): it forms again",
                    epoch.number, ahead["step"], step, "live" if live else "not live")
        self.set_status(state="forming", epoch=epoch.number, why=f"{self.name(self.member)} was not at step {ahead['step']}")
        return None

    def _groups_alive(self, alive: dict[int, str] | None = None) -> int:
        return len({m // self.procs for m in (self.alive() if alive is None else alive)})

    def _groups_heard(self, coordinator: int) -> int:
        """Groups alive, as this member hears them, or as the coordinator says (it hears every member)."""
        heard = self._groups_alive()
        with self._lock:
            told = self._seen.get(coordinator, {}).get("groups", 0) if coordinator != self.member else 0
        return max(heard, told)

    def _request(self, coordinator: int, step: int, live: bool, min_groups: int) -> Epoch | None:
        """The next epoch as `coordinator` forms it: this member forms it, if it is the coordinator; else asks.
        (In a tree, a member that hears no lower member but still looks for its parent waits: None. One that
        hangs from a parent asks up the tree, whoever the root is now: its own heartbeats are the only ones
        it hears but the root's, and a leaf that had not yet heard the new root's asked nobody, and missed
        the survivors' first epoch.)"""
        if coordinator != self.member or (self.links.tree and self.links.parent is not None):
            return self._ask(coordinator, step, live)
        if not self.links.is_root():
            time.sleep(self.heartbeat_s / 2)
            return None
        return self._coordinate(step, live, min_groups)

    def _ask(self, coordinator: int, step: int, live: bool) -> Epoch | None:
        rid = secrets.token_hex(6)
        with self._lock:
            self._pending.add(rid)
        try:
            request = Join(rid, step, live, self.max_epoch, self.own_store().port)
            self.links.send(coordinator, request)
            deadline = time.monotonic() + 5 * self.lost_after_s + 6  # a request the coordinator passed over
            again = time.monotonic() + self.lost_after_s
            while min(self.alive()) == coordinator and time.monotonic() < deadline:
                seen = self._news_n
                if time.monotonic() > again:  # asked again now and then: a request lost with its channel (the
                    again = time.monotonic() + self.lost_after_s  # coordinator takes the newest) is not waited for
                    with contextlib.suppress(OSError):
                        self.links.send(coordinator, request)
                with self._lock:
                    reply = self._replies.pop(rid, None)
                    if reply is None and self._invited is not None:  # (the coordinator and the others wait for it)
                        reply, self._invited = self._invited, None
                if isinstance(reply, Wait):  # (the coordinator is not whole, or it is not the coordinator)
                    self.links.hurry(range(coordinator))
                    return None
                if reply is not None and reply.number <= self.status.epoch:
                    reply = None  # an epoch this member trained in or left (its request came before the heartbeat
                    # that says so): the coordinator hears that, and takes the request when it comes again
                if reply is not None:
                    members = list(reply.members)
                    if not counts_in(members, self.member, self.incarnation):
                        self.links.drop(self.name(coordinator), f"an epoch {reply.number} without this member")
                        return None
                    rank = [m.number for m in members].index(self.member)
                    return Epoch(reply.number, members, rank, key=reply.key)
                # until news (an answer, a member heard or lost), or what only time changes: the request due
                # again, the coordinator silent (a thousand members polling every 50 ms while they asked, 20,000
                # wake-ups a second in the membership-sim, starved the root that was to answer them)
                self._await_news(seen, min(again, deadline, self._silent_at(coordinator)) - time.monotonic())
            return None
        finally:
            with self._lock:  # an answer that comes later is dropped: nothing waits for it
                self._pending.discard(rid)
                self._replies.pop(rid, None)

    def _coordinate(self, step: int, live: bool, min_groups: int) -> Epoch | None:
        """Wait for a join request from every member alive (a member finishing its step comes within a
        step; one that never asks is left out after a while), then announce the epoch to them."""
        started = time.monotonic()
        with self._lock:  # (the last epoch's news answers no request for this one)
            self._announced = None
        while True:
            seen = self._news_n
            alive = self.alive()
            if min(alive) != self.member:
                return None
            broken = self.broken()  # a group that lost a process leaves whole: not waited for, not let in
            if self.member in broken:  # this one's too: forming stops (Replicas.form's should_stop says why)
                return None
            with self._lock:
                asked = {m: r for m, r in self._requests.items() if alive.get(m) == r[1]}
                starting = {m for m, s in self._seen.items() if s.get("state") == "starting"}
                # a coordinator that just started (or just became the lowest member alive) has not heard every
                # live member yet: one whose first heartbeat is on its way would be left out, and then healed
                # as a new member; one it heard before and lost since is not waited for
                unheard = (len(self._seen) < self.members - 1
                           and time.monotonic() - (self._since or 0.0) < self.lost_after_s)
            if (set(alive) - {self.member} - starting - broken <= set(asked) and not unheard
                    or time.monotonic() - started > 5 * self.lost_after_s + 5):
                break
            self._await_news(seen, 0.05)
        with self._lock:
            for m in asked:
                del self._requests[m]
        # whole groups only: a group's processes train together (sharded, they cannot train apart)
        here = set(asked) | {self.member}
        partial = {m for m in here if m in broken or not set(self.siblings(m)) <= here}
        waiting = list(asked) if self.member in partial else [m for m in asked if m in partial]
        for m in waiting:
            request, _, conn = asked.pop(m)
            with contextlib.suppress(OSError):
                conn.send(Wait(request.id))
        if self.member in partial:  # this one's own group is not all here yet: no epoch now, ask again
            return None
        members = sorted([Member(self.member, self.incarnation, step, live, self.own_store().port)]
                         + [self._member(m, request, inc, step, live) for m, (request, inc, _) in asked.items()],
                         key=lambda m: m.number)
        if len({m.number // self.procs for m in members}) < min_groups:
            for request, _, conn in asked.values():
                with contextlib.suppress(OSError):
                    conn.send(Wait(request.id))
            return None
        number = max([self.max_epoch] + [r[0].epoch_seen for r in asked.values()]) + 1
        news = EpochNews("0", number, secrets.token_hex(6), tuple(members))
        with self._lock:  # a member that missed its answer (it asked again meanwhile) is answered with it
            self._announced, self._announced_at = news, time.monotonic()
        if self.links.tree:  # down the tree once, for all (each member takes it as the answer to its request)
            self.links.broadcast(news)
        else:
            line = encode(news)  # encoded once (an epoch of a thousand members is 40 kB), each request's id put in
            for request, _, conn in asked.values():
                with contextlib.suppress(OSError):  # it is lost: forming the group notices
                    conn.send(line.replace(b'"id": "0"', f'"id": "{request.id}"'.encode(), 1))
        last = max(asked, key=lambda m: self._asked_at.get(m, 0.0), default=None)
        return Epoch(number, members, [m.number for m in members].index(self.member), news.key,
                     last_request=None if last is None else (last, max(0.0, self._asked_at.get(last, started) - started)))

    def _tell(self) -> None:
        """News of a member (a request, a reply, a state, a member heard or lost): a forming member looks again."""
        with self._news:
            self._news_n += 1
            self._news.notify_all()

    def _await_news(self, seen: int, timeout_s: float) -> None:
        """Until news after the `seen`-th (`_news_n` when the waiter last looked), or `timeout_s` (what only
        time changes: a silent member, a deadline); then 2 ms more, for news that comes together. A forming
        member polled every 2 ms, looking at every member it hears each time: at 128 members in one
        process, that was its CPU."""
        with self._news:
            if not self._news.wait_for(lambda: self._news_n != seen, timeout_s):
                return
        time.sleep(0.002)

    def _member(self, member: int, request: Join, inc: str, step: int, live: bool) -> Member:
        """A member of the next epoch as this coordinator knows it. Having trained in the last epoch (it
        may then be a heal source) is what this coordinator's own record says, not the member's claim;
        its step may differ from this one's by the step in flight only. A coordinator with no record of
        its own (it restarted) takes the members' claims: they come over the authenticated channel."""
        if not live or self.last is None:
            return Member(member, inc, request.step, request.live, request.store)
        was = counts_in(self.last.members, member, inc)
        if was and request.live and abs(request.step - step) <= 1:  # (a claim not to be live is taken)
            return Member(member, inc, request.step, True, request.store)
        if not request.live:  # a claim not to be live is taken: it is healed
            return Member(member, inc, request.step, False, request.store)
        if member not in self._told_claims:  # a claim the record contradicts: healed, not trusted
            self._told_claims.add(member)
            log.warning("replica %s claims to have trained to step %d in an epoch, where this coordinator's record "
                        "(epoch %d, step %d) says otherwise: it is healed like a new member", self.name(member),
                        request.step, self.last.number, step)
        return Member(member, inc, 0, False, request.store)

    def own_store(self) -> dist.TCPStore:
        """This member's rendezvous store (made once, on its beacon's host: nothing listens wider than it
        must): the pairs of an epoch's links meet on the store of their lower-ranked member, so a
        member's store serves two pairs an epoch, whatever the job's size (the coordinator's served
        every pair: at 32 groups, making the links took 0.4 to 1 s there)."""
        with self._lock:
            if self._rendezvous is None:
                self._rendezvous = bound_store(self.links.addresses[self.member][0], 0, True,
                                               datetime.timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
            return self._rendezvous

    def _stores(self, members: list[Member], timeout: datetime.timedelta) -> Callable[[int], dist.Store]:
        """Rank -> the rendezvous store of `members`' member of that rank: this member's own, or a client of
        another's (made when a pair first needs it, kept with the epoch's links)."""
        clients: dict[int, dist.Store] = {}
        lock = threading.Lock()  # (a ring makes its pairs in threads of their own)

        def store(rank: int) -> dist.Store:
            m = members[rank]
            if m.number == self.member:
                return self.own_store()
            with lock:
                if m.number not in clients:
                    clients[m.number] = dist.TCPStore(self.links.addresses[m.number][0], m.store, is_master=False,
                                                      timeout=timeout)
                return clients[m.number]
        return store

    def _make_group(self, epoch: Epoch, timeout_s: float) -> None:
        """The epoch's links (a ring, and a ring per shard), made in a thread so that a member lost meanwhile
        is noticed. A member slow to take it (a loaded node) is waited for, up to timeout_s, as a collective
        waits for it: slow is not lost, and leaving it out would only start another epoch for it to be slow in."""
        timeout = datetime.timedelta(seconds=timeout_s)
        out: dict = {}

        def make():
            try:
                name = f"replicas-epoch-{epoch.number}-{epoch.key}"
                ring = out["pg"] = Ring(self._stores(epoch.members, timeout), self.secret, name, epoch.rank,
                                        epoch.world, timeout)
                ring.connect(ring.neighbours())
                if self.sharded:
                    holders = epoch.holders(self.member, self.procs)
                    shard = f"{name}-shard-{self.member % self.procs}"
                    ring = out["shard_pg"] = Ring(self._stores(holders, timeout), self.secret, shard,
                                                  [m.number for m in holders].index(self.member), len(holders), timeout)
                    ring.connect(ring.neighbours())
            except Exception as e:  # noqa: BLE001 - reported to the waiting thread
                out["error"] = e

        thread = threading.Thread(target=make, daemon=True)
        thread.start()
        started = time.monotonic()
        while thread.is_alive():  # (making it is most of a loaded node's work: its beats may be late)
            if (lost := self.lost(epoch, at_least=4 * self.lost_after_s)) is not None:
                raise lost
            thread.join(0.005)
        if "error" in out:
            raise MembershipChanged(str(out["error"]).splitlines()[0][:200])
        epoch.pg, epoch.shard_pg = out["pg"], out.get("shard_pg")
        epoch.setup_s = time.monotonic() - started

    # --- what members say (records parsed once, at the edge: link.py) -----------------------------------
    def _heard(self, member: int, inc: str, msg, channel: Channel) -> str | None:
        """A record from member `member` (incarnation `inc`): its heartbeat, or a join request to this
        coordinator; else why it is dropped."""
        news, root = None, isinstance(msg, Join) and self.links.is_root()  # (links' lock before ours, not inside it)
        everyone, now = False, time.monotonic()
        with self._lock:
            if isinstance(msg, Heartbeat):
                was = self._seen.get(member)
                same = was is not None and not was["eof"] and was["inc"] == inc
                # the longest recent gap between its heartbeats, halved every SLACK_HALF_LIFE_S (`_patience`): a
                # member starved once is likely starved again (its node is loaded) for a minute or so. (It
                # faded by 1% a heartbeat: in 10 s at 8 a second, and a coordinator's successor on 1/16 of a
                # core, starved 1.3 s at step 23 of a 32-group run, was taken for lost again at step 26.)
                slack = 0.0
                if same:
                    gap = now - was["t"]
                    slack = max(gap, was.get("slack", 0.0) * 0.5 ** (gap / SLACK_HALF_LIFE_S))
                if same and was.get("hb") == msg:  # (most beats: nothing new but that it is alive)
                    late = now - was["t"] >= self._patience(was)
                    was.update(t=now, slack=slack)
                    if late:
                        self._tell()
                        self.links.wake()
                    return None
                # (a flat record: asdict's deep copy was half of a root's time at 256 members)
                self._seen[member] = {**vars(msg), "hb": msg, "inc": inc, "t": now, "eof": False, "slack": slack}
                if (not same or was["state"] != msg.state
                        or (was["epoch"], was["ended"], was["done"]) != (msg.epoch, msg.ended, msg.done)
                        or now - was["t"] >= self._patience(was)):
                    self._tell()
                    self.links.wake()  # (a coordinator's verdict may change: the members hear it now)
                self.max_epoch = max(self.max_epoch, msg.epoch)
            elif isinstance(msg, (EpochNews, Wait)):
                return self._reply(msg)
            elif isinstance(msg, Join) and (self._lower_alive() or not root):
                # not the coordinator (a lower member is back, or the asker has not heard of it): said at
                # once, and the asker looks for a lower member now
                news = Wait(msg.id)
            elif isinstance(msg, Join):
                news = self._announced
                if (news and counts_in(news.members, member, inc)
                        and self._seen.get(member, {}).get("epoch", -1) < news.number
                        and not (self.status.state == "forming" and self.status.epoch >= news.number)):
                    # a member of the epoch this coordinator is in that has not been in it (its answer was lost:
                    # one of 16 groups never had it, and its neighbours waited 30 s for it): answered with it
                    self._requests.pop(member, None)
                    if self.links.tree:  # down the tree once again, for all, at most once a heartbeat (at 512
                        # members, hundreds asked again before the first came down, each answered with all of it)
                        everyone = now - self._announced_at >= self.heartbeat_s
                        self._announced_at, news = (now, news) if everyone else (self._announced_at, None)
                else:
                    news = None
                    if member not in self._requests:  # (a request sent again does not make it later)
                        self._asked_at[member] = time.monotonic()
                    self._requests[member] = (msg, inc, channel)
                    self._tell()
            else:
                return f"a {type(msg).__name__} sent to a beacon"
        if news and everyone:
            self.links.broadcast(news)
        elif news:  # (or it missed the answer to an earlier request)
            with contextlib.suppress(OSError):
                channel.send(replace(news, id=msg.id))

    def _hung_up(self, member: int, inc: str) -> None:
        """Member `member`'s (incarnation `inc`) connection to this server ended: it is lost."""
        with self._lock:
            if self._seen.get(member, {}).get("inc") == inc:
                self._seen[member].update(eof=True, eof_t=time.monotonic())
        self._tell()
        self.links.wake()

    def _invites(self, news: EpochNews) -> bool:
        """Whether `news` counts this member, forming now (or asking: a tree's announcement answers every
        request), into an epoch newer than its last (under the lock)."""
        return ((self.status.state == "forming" or self._pending) and news.number >= self.max_epoch
                and (self.last is None or news.number > self.last.number)
                and counts_in(news.members, self.member, self.incarnation))

    def _reply(self, msg) -> str | None:
        """A coordinator's answer to one of our requests (under the lock); else why it is dropped."""
        if msg.id in self._pending:
            self._replies[msg.id] = msg
            self._tell()
            return None
        if isinstance(msg, EpochNews) and self._invites(msg):
            # it answers a request this member gave up on (the coordinator it asked seemed lost a moment,
            # or another seemed lower): the coordinator counted it in, and the epoch waits for it
            self._invited = msg
            self._tell()
            return None
        if isinstance(msg, EpochNews) and msg.id == "0":
            return None  # (a tree's announcement, to every member: one not asking has nothing to take)
        return f"a {type(msg).__name__} that answers no request of ours"
