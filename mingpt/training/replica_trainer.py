"""The Trainer of a replica group's process (mingpt.replicas): the same loop, with the step cut into
shares exchanged with the other groups, and an epoch formed again (and the state healed) whenever a
group is lost or returns. The base loop does not know it: this class overrides the Trainer's seams,
sets its role, and gives the save policy its rule (torchtitan's FaultTolerantTrainer pattern: a
subclass, chosen by main.py in one line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from mingpt.replicas import MembershipChanged, Replicas, Rows
from mingpt.replicas.standby import release
from mingpt.training.metrics import peak_flops
from mingpt.training.state import Role, StepStats
from mingpt.training.trainer import StopTraining, Trainer

log = logging.getLogger(__name__)

LOOK_EVERY_S = 5.0  # how often a member waiting to join, or a spare, looks whether the run finished


class ReplicaTrainer(Trainer):
    """A Trainer whose process is a member of replica groups.

    Args:
        replicas: this process's side of the groups: its shares, the exchange, epochs, healing.
        resume: loads the snapshot the start found, into the trainer given; called only if no member
            of the first epoch is live (the job restarts), since a live member's state is healed instead.
        joined: called once this member joined its first epoch (its step is known only then).
    """

    def __init__(self, *, replicas: Replicas, resume: Callable[[Trainer], None] | None = None,
                 joined: Callable[[Trainer], None] | None = None, **parts):
        super().__init__(**parts)
        self.replicas, self.resume, self.joined = replicas, resume, joined
        self.run_over = RunFinished(self.snapshotter.store, self.cfg.max_steps)  # (while this group was away)
        self._redo = None  # (step, Rows: the shares' gradients) computed when that step's epoch broke
        self.role = self.epoch_role()
        self.policy.agreed = lambda: replicas.flags  # as each step's exchange agreed them: no collective of its own

    def epoch_role(self) -> Role:
        """The epoch's first member logs for the job; one member (or one group, a shard each) saves for it."""
        r = self.replicas
        running = len(r.epoch.groups(r.procs)) if r.epoch is not None else r.groups
        return Role(leads=r.leads, saves=r.saves,
                    name=f"replica {r.me} ({running} of {r.groups} groups)" if running < r.groups
                    else f"replica {r.me} ({r.groups} groups)")

    def train(self) -> bool:
        """The Trainer's run; each other group's console says it ended too (the epoch's first member
        says `finished: ...` for the job, and writes the snapshot)."""
        finished = super().train()
        if finished and not self.role.leads and self.info.is_rank0 and self.progress.step >= self.cfg.max_steps:
            log.info("finished: step %d, with the other replica groups; the epoch's first member wrote the snapshot "
                     "to %s (sample: mingpt-generate %s)", self.progress.step, self.snapshotter.store.url, self.cfg.run_dir)
        return finished

    # --- the Trainer's seams -------------------------------------------------------------------------
    def begin(self) -> None:
        if not self.regroup("start"):
            raise StopTraining(self.run_over.seen)
        if self.joined is not None:
            self.joined(self)

    def train_step(self) -> StepStats | None:
        before = self.data.sampler.state_dict()
        try:
            return super().train_step()
        except MembershipChanged as e:  # the step is dropped on every member; the next epoch trains it
            log.warning("replica epoch %d ended at step %d: %s; the next epoch trains the step again",
                        self.replicas.epoch.number, self.progress.step, e)
            self.data.sampler.load_state_dict(before)
            if not self.regroup(str(e), e.cause):
                raise StopTraining(self.run_over.seen) from None
            return None

    def after_step(self) -> bool:
        r = self.replicas
        if not r.rejoin_pending:
            return False
        why = "a group joins"  # a group waits to join: let it in now, between steps
        if r.leaving:  # (or one leaves: a stop signal reached it, and it stopped after this step)
            why = f"group{'s' * (len(r.leaving) > 1)} {', '.join(map(str, r.leaving))} left the job (a stop signal)"
            log.warning("replica %s after step %d; the others train on without it (a new process of it heals and "
                        "rejoins)", why, self.progress.step)
        if not self.regroup(why):
            raise StopTraining(self.run_over.seen)
        return True  # a member behind the others was healed forward

    def compute(self, step: int, micro_batches: list, global_tokens: int) -> tuple[torch.Tensor, list]:
        """This member's shares of the step, exchanged (`Replicas.reduce`); their summed token loss, and the
        split. Its own shares are folded into one accumulator as they are trained, a lost owner's dealt
        to it kept a row each (`Rows`). Shares done when an epoch broke are kept for the step's redo
        (the same weights and samples, the same gradients): the accumulator's own shares, and the rows
        of those still dealt to this member."""
        r = self.replicas
        # the split of a world of one rank per share, whichever groups are alive (sharded groups: every
        # share cut into a part per data rank of the group)
        split = self.data.sampler.split(micro_batches, r.shares_total * r.parts)
        mine = r.shares()
        rows = self._redo[1].keep(mine) if self._redo and self._redo[0] == step else Rows(r.own())
        if len(rows):
            log.info("step %d trained again: %d of this group's shares done before the fault kept", step, len(rows))
        started = time.monotonic()
        try:
            for share in mine:  # (in share order: its own shares are folded in that order)
                if share not in rows:
                    part = split[share * r.parts + r.part]
                    # the shares' gradients are summed by the exchange: the backward averages over a share's parts
                    loss = self.forward_backward(step, part, micro_batches, global_tokens, r.parts)
                    rows.add(share, self.parallel.gpt, loss, part)
                    if r.membership.decides_alone:  # a member lost: on to the redo now, not after the other
                        r.check()  # shares (whole groups: the group's processes decide together, in the exchange)
            self.ledger.switch("step_compute")
            total = r.reduce(self.parallel.gpt, rows, step, self.policy.preempt.requested, self.policy.interval_elapsed(),
                             time.monotonic() - started)
        except MembershipChanged:
            self._redo = (step, rows)
            raise
        self._redo = None
        if r.flags[0] and r.staying:  # this group stops after this step: the job does not
            log.warning("%s: replica %s leaves the job after step %d; the other groups train on (the same command "
                        "brings it back, healed from them)", self.policy.preempt.describe(), r.me, step + 1)
        return torch.tensor(total, device=self.device), split

    def says_stop(self) -> bool:
        # this group leaves while the others train on: its line at the exchange said so (`compute`), and
        # "the same command resumes from" the snapshot is not what happens: the others heal it
        return not (self.replicas.flags[0] and self.replicas.staying)

    def record_extra(self) -> dict:
        epoch = self.replicas.epoch
        return {"world_size": epoch.world, "members": epoch.numbers(), "shares": self.replicas.shares_record,
                "group_compute_ms": self.replicas.group_compute}

    def peak(self) -> float:
        # Every live group's hardware: the tokens/s logged beside MFU are the job's (every share of the
        # step), over a step time the exchange makes common to all groups. Not this group's own shares over
        # its own peak: that is the logging group's figure only, and differs from the others' while a lost
        # group's shares are dealt out. A group is one node: a member per process (a GPU each), a machine
        # per group on CPU (`procs` processes per node).
        job = replace(self.info, world_size=self.replicas.epoch.world, local_world_size=self.replicas.procs)
        return peak_flops(self.cfg, job, self.device)

    def close(self, wait: bool = True) -> None:
        super().close(wait)  # (the leader's last snapshot committed)
        done = wait and self.progress.step >= self.cfg.max_steps
        if done and self.replicas.epoch is not None:
            self.replicas.finish()  # none exits while another is still in the last exchange
        if done or (wait and self.run_over.seen):  # the run is over: the member's lock file goes (standby.py)
            release(self.replicas.beacon.secret, self.replicas.beacon.member)
        self.replicas.close()

    # --- epochs --------------------------------------------------------------------------------------
    def regroup(self, why: str, cause: str = "") -> bool:
        """Form the next epoch and bring every member to the newest state among them; False when a
        preemption signal came first (the process stops without saving: it is no member), or the
        other groups finished the run meanwhile. `cause`: the last epoch's root cause, if not `why`."""
        t0, p, last = time.monotonic(), self.progress, self.replicas.epoch
        with self.ledger.during("regroup"):
            while True:
                epoch = self.replicas.form(p.step, lambda: self.policy.preempt.requested or self.run_over(),
                                           cause or why)
                self.role = self.epoch_role()
                if epoch is None and self.run_over.seen:
                    log.info("the other replica groups finished the run (its snapshot of step %d is committed) while "
                             "this group was away: nothing left to train", self.cfg.max_steps)
                    return False
                if epoch is None:
                    log.warning("%s while waiting to join the replica groups", self.policy.preempt.describe())
                    return False
                self.metrics.enabled = self.role.leads  # one member writes the job's records
                if self.resume is not None and not any(m.live for m in epoch.members):  # the job (re)starts
                    with self.ledger.during("restore"):
                        self.resume(self)
                    self.resume = None
                    continue  # announce the step loaded
                self.resume = None  # a live member holds the job's state: heal from it, never load
                try:
                    heal = self.replicas.heal(self.parallel.held(self.optimizer), self.state_json,
                                              self.load_state)
                    break
                except MembershipChanged as e:  # lost while healing: form the next epoch
                    log.warning("replica epoch %d ended while healing: %s", epoch.number, e)
                    why, cause = str(e), e.cause
        name, source, healed = self.replicas.beacon.name, heal.source, heal.members
        if self.replicas.beacon.member in healed:
            self._redo = None  # other weights now: nothing computed before holds
            log.info("healed from replica %s: at step %d", name(source), p.step)
        if last is not None:  # (at this member's start every group joins: the epoch's line says which)
            procs = self.replicas.procs
            for g in sorted(epoch.groups(procs) - last.groups(procs)):
                log.info("replica group %d joined at step %d%s", g, p.step,
                         f", healed from {name(source)}" if g * procs in healed else "")
        if self.role.leads:
            self.metrics.write({"kind": "epoch", "step": p.step, "epoch": epoch.number, "members": epoch.numbers(),
                                "procs": self.replicas.procs,
                                "why": why, "regroup_s": round(time.monotonic() - t0, 4), "healed": healed,
                                "healed_from": source if healed else None})
        return True

class RunFinished:
    """Whether the run's last snapshot is committed: looked for in `store` every few seconds at most,
    the first time after `first_look_s` (an unreadable store: not yet, said at each look); once seen,
    for good."""

    def __init__(self, store, max_steps: int, first_look_s: float = 0.0):
        self.store, self.max_steps, self.seen = store, max_steps, False
        self._next = time.monotonic() + first_look_s

    def __call__(self) -> bool:
        if not self.seen and time.monotonic() >= self._next:
            self._next = time.monotonic() + LOOK_EVERY_S
            try:
                self.seen = any(s.committed and s.step >= self.max_steps for s in self.store.list())
            except Exception as e:  # noqa: BLE001 - an unreadable store: keep waiting for the groups
                log.warning("cannot list %s (%s); waiting on", self.store.url, e)
        return self.seen
