"""The base loop (mingpt/training/trainer.py) on its own: no model, no process group, no subsystem.
Steps are scripted; what the loop does after each one comes from `decide`, in nanoGPT's order."""

import contextlib
import logging
from types import SimpleNamespace

import pytest

from mingpt.runtime.exits import PreemptionFlag
from mingpt.training.policy import SavePolicy
from mingpt.training.state import Progress, Role, StepStats
from mingpt.training.trainer import StopTraining, Trainer


class Scripted(Trainer):
    """The loop around a clock: every step 10 ms and 100 tokens; what it did, in order, in `done`; the
    steps it trained, dropped ones too, in `trained`."""

    def __init__(self, max_steps: int, every_steps: int, preempt_at: int | None = None, drop_at: int | None = None):
        self.progress, self.done, self.trained, self.clock = Progress(), [], [], 0.0
        self.preempt_at, self.drop_at = preempt_at, drop_at
        self.cfg = SimpleNamespace(max_steps=max_steps, log_every=5, eval_every=10)
        self.ledger = SimpleNamespace(step_seconds=lambda: self.clock, steady=True)
        self.watchdog = SimpleNamespace(beat=lambda step: None)
        preempt = PreemptionFlag(announce=False)  # one process: its own flags are every rank's
        self.policy = SavePolicy(every_steps, 0.0, preempt, device=None, agreed=lambda: (preempt.requested, False))
        self.info, self.role = SimpleNamespace(is_rank0=True), Role(leads=True, saves=True, name="1 rank")

    def train_step(self) -> StepStats | None:
        self.clock += 0.01
        self.trained.append(self.progress.step)
        if self.progress.step == self.preempt_at:
            self.policy.preempt.signum = 15  # SIGTERM arrives during this step
        if self.progress.step == self.drop_at:  # e.g. a replica group lost during it: trained again
            self.drop_at = None
            return None
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


def test_a_dropped_step_is_trained_again_and_counted_once():
    """A layer's train_step that returns None dropped the step (a replica epoch broke during it): the
    loop trains the same step again; the step, the tokens and the records count it once, and the
    step time logged leaves out the dropped attempt's."""
    t = Scripted(max_steps=12, every_steps=6, drop_at=7)
    assert t._loop(SimpleNamespace(update=lambda n: None)) is True
    assert t.trained == [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11]
    assert t.progress.step == 12 and t.progress.tokens_seen == 1200
    assert t.done == [("log", 5, 0.01), ("save", 6), ("log", 10, 0.01), ("eval", 10),
                      ("log", 12, 0.01), ("eval", 12), ("save", 12), ("finish", 12)]


def ready_to_train(t: Scripted, begin) -> Scripted:
    """`t` with what train() itself asks for, and `begin` as its layer's start."""
    t.begin = begin
    t.amp_dtype, t.parallel = None, "single"
    t.cfg.progress, t.cfg.deterministic = False, False
    t.info.is_rank0, t.role = False, Role(leads=False, saves=True, name="1 rank")
    t.watchdog = SimpleNamespace(start=lambda: None, stop=lambda: None, beat=lambda s: None)
    t.ledger.switch = lambda state: None
    t.record_time = lambda: None
    return t


@pytest.mark.parametrize("finished", [True, False])
def test_a_layer_ends_the_run_through_stop_training(finished):
    """A layer's hook (e.g. replica groups finding the run finished elsewhere) ends train() with its word."""
    def begin():
        raise StopTraining(finished)

    t = ready_to_train(Scripted(max_steps=10, every_steps=0), begin)
    assert t.train() is finished and t.progress.step == 0


def test_the_start_line_and_the_progress_bar_count_from_the_step_the_layer_starts_at(monkeypatch, caplog):
    """A replica group that returns learns its step in its layer's start (healed from the others to step
    73 of 300): the start line and the progress bar (its percent and time left) count from there, not
    from the step it had before."""
    import mingpt.training.trainer as trainer

    t = Scripted(max_steps=300, every_steps=0)
    t = ready_to_train(t, lambda: setattr(t.progress, "step", 73))
    t.cfg.progress = t.info.is_rank0 = True
    t.role = Role(leads=True, saves=True, name="1 rank")
    t.cfg.run_dir, t.snapshotter = "runs/x", SimpleNamespace(store=SimpleNamespace(url="runs/x/snapshots"))
    bars = []

    @contextlib.contextmanager
    def progress_bar(enabled, start, total):
        bars.append([enabled, start, total, 0])
        yield SimpleNamespace(update=lambda n: bars[-1].__setitem__(3, bars[-1][3] + n))

    monkeypatch.setattr(trainer, "progress_bar", progress_bar)
    caplog.set_level(logging.INFO, logger="mingpt")
    assert t.train() is True
    assert "training from step 73 to 300 on 1 rank (single), precision fp32" in caplog.text
    assert bars == [[True, 73, 300, 300 - 73]]
