"""The step time (and so tok/s and MFU) of every logged step is measured over the steps this member
trained: a replica heal or a regroup moves its step without training, and must not count as steps."""

from types import SimpleNamespace

import pytest

from mingpt.replicas import MembershipChanged
from mingpt.training.replica_trainer import ReplicaTrainer
from mingpt.training.state import Progress, StepStats, Todo
from mingpt.training.trainer import Trainer

STEP_S = 0.05  # every step takes 50 ms of the ledger's step states


class ScriptedStep(Trainer):
    """A step of 50 ms, in which a peer may be lost (`lose_at`): the step under the replica layer's
    train_step, which drops it and regroups."""

    def train_step(self) -> StepStats:
        self.clock += STEP_S
        if self.progress.step == self.lose_at:  # a peer lost mid-step: the step is dropped, trained again
            self.lose_at = None
            raise MembershipChanged("group 2 lost")
        return StepStats(None, 1000, None, 1e-3, STEP_S, [])


class Member(ReplicaTrainer, ScriptedStep):
    """The loop of a replica member, around a clock and a scripted membership (no model, no process
    group): `heals` maps the regroup's reason to the step the member is healed to there. (Its steps are
    ScriptedStep's: below ReplicaTrainer in the method order, its super().)"""

    def __init__(self, max_steps: int, heals: dict, lose_at: int | None = None, join_at: int | None = None):
        self.progress, self.cfg, self.clock = Progress(), SimpleNamespace(max_steps=max_steps), 0.0
        self.ledger = SimpleNamespace(step_seconds=lambda: self.clock)
        self.watchdog = SimpleNamespace(beat=lambda step: None)
        self.replicas = SimpleNamespace(rejoin_pending=False, leaving=[], epoch=SimpleNamespace(number=3))
        self.data = SimpleNamespace(sampler=SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None))
        self.heals, self.lose_at, self.join_at, self.logged = heals, lose_at, join_at, {}
        self.joined = None

    def regroup(self, why: str, cause: str = "") -> bool:
        self.progress.step = self.heals.get(why, self.progress.step)
        self.replicas.rejoin_pending = False
        return True

    def decide(self, step: int) -> Todo:
        self.replicas.rejoin_pending = step == self.join_at
        return Todo(log=step % 10 == 0)

    def _log_train(self, stats: StepStats, step_s: float) -> None:
        self.logged[self.progress.step] = step_s

    def finish_saving(self, why: str) -> None:
        pass


@pytest.mark.parametrize("member", [
    Member(150, {"start": 130}),  # a restarted group healed from step 0 to 130 by a live one
    Member(150, {"group 2 lost": 137}, lose_at=125),  # healed forward at a regroup after a fault
    Member(150, {"a group joins": 134}, join_at=125),  # a member behind the others, healed as a group joins
], ids=["heal at start", "heal after a fault", "heal as a group joins"])
def test_a_logged_step_time_is_that_of_the_steps_trained_here(member):
    member.begin()  # train()'s start, then its loop
    start, shown = member.progress.step, []
    assert member._loop(SimpleNamespace(update=shown.append))
    assert member.logged and max(member.logged) == 150
    assert start + sum(shown) == 150  # the progress bar shows the job's step, the heals' steps included
    for step, step_s in member.logged.items():
        assert step_s == pytest.approx(STEP_S), (step, member.logged)
