"""The base loop (mingpt/training/trainer.py) on its own: no model, no process group, no subsystem.
Steps are scripted; what the loop does after each one comes from `decide`, in nanoGPT's order."""

from types import SimpleNamespace

import pytest

from mingpt.runtime.distributed import PreemptionFlag
from mingpt.training.policy import SavePolicy
from mingpt.training.state import Progress, StepStats
from mingpt.training.trainer import StopTraining, Trainer


class Scripted(Trainer):
    """The loop around a clock: every step 10 ms and 100 tokens; what it did, in order, in `done`."""

    def __init__(self, max_steps: int, every_steps: int, preempt_at: int | None = None):
        self.progress, self.done, self.clock, self.preempt_at = Progress(), [], 0.0, preempt_at
        self.cfg = SimpleNamespace(max_steps=max_steps, log_every=5, eval_every=10)
        self.ledger = SimpleNamespace(step_seconds=lambda: self.clock, steady=True)
        self.watchdog = SimpleNamespace(beat=lambda step: None)
        self.policy = SavePolicy(every_steps, 0.0, PreemptionFlag(announce=False), device=None)
        self.info = SimpleNamespace(is_rank0=True)

    def agreed_flags(self):  # one process: its own flags are every rank's
        return (self.policy.preempt.requested, False)

    def train_step(self) -> StepStats:
        self.clock += 0.01
        if self.progress.step == self.preempt_at:
            self.policy.preempt.signum = 15  # SIGTERM arrives during this step
        return StepStats(None, 100, None, 1e-3, 0.01, [])

    def _log_train(self, stats, step_s):
        self.done.append(("log", self.progress.step, round(step_s, 4)))

    def evaluate(self):
        self.done.append(("eval", self.progress.step))

    def save_snapshot(self):
        self.policy.saved()
        self.done.append(("save", self.progress.step))

    def record_time(self):
        pass

    def finish_saving(self, why):
        self.done.append(("finish", self.progress.step))


def test_the_loop_trains_to_max_steps_and_does_each_thing_at_its_interval():
    t = Scripted(max_steps=12, every_steps=6)
    assert t._loop(SimpleNamespace(update=lambda n: None)) is True
    assert t.progress.step == 12 and t.progress.tokens_seen == 1200
    assert t.done == [("log", 5, 0.01), ("save", 6), ("log", 10, 0.01), ("eval", 10),
                      ("log", 12, 0.01), ("eval", 12), ("save", 12), ("finish", 12)]


def test_a_preemption_saves_the_step_it_arrived_in_and_stops():
    t = Scripted(max_steps=100, every_steps=0, preempt_at=7)
    assert t._loop(SimpleNamespace(update=lambda n: None)) is False
    assert t.progress.step == 8 and t.done[-2:] == [("save", 8), ("finish", 8)]


@pytest.mark.parametrize("finished", [True, False])
def test_a_layer_ends_the_run_through_stop_training(finished):
    """A layer's hook (e.g. replica groups finding the run finished elsewhere) ends train() with its word."""
    t = Scripted(max_steps=10, every_steps=0)

    def begin():
        raise StopTraining(finished)

    t.begin = begin
    t.amp_dtype, t.parallel = None, "single"
    t.where = lambda: "1 rank"
    t.cfg.progress, t.cfg.deterministic = False, False
    t.info.is_rank0 = False
    t.watchdog = SimpleNamespace(start=lambda: None, stop=lambda: None, beat=lambda s: None)
    t.ledger.switch = lambda state: None
    assert t.train() is finished and t.progress.step == 0
