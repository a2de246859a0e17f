"""When the loop saves a snapshot and when it stops: every N steps and/or every T seconds (0 = off),
at the last step, and at a preemption signal (save, then stop). Every rank decides the same."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mingpt.runtime.distributed import all_reduce_sum
from mingpt.runtime.exits import PreemptionFlag


def decide(step: int, last: bool, every_steps: int, timed: bool, preempted: bool) -> tuple[bool, bool]:
    """(save now, stop after saving) after `step`: the whole rule, as a table the tests read."""
    save = preempted or timed or last or bool(every_steps and step % every_steps == 0)
    return save, preempted and not last


class SavePolicy:
    """`decide` over what every rank knows: the step, and two flags that differ by rank (a signal
    arrives at one process; clocks drift), agreed by one tiny all-reduce, or by `agreed`: the rule of a
    layer whose step agrees them otherwise (replica groups' exchange), (preempted, interval elapsed)."""

    def __init__(self, every_steps: int, every_s: float, preempt: PreemptionFlag, device: torch.device,
                 agreed: Callable[[], tuple[bool, bool]] | None = None):
        self.every_steps, self.every_s, self.preempt, self.device = every_steps, every_s, preempt, device
        self.agreed = agreed
        self.last_save_t = time.monotonic()

    def stop_requested(self) -> bool:
        """A preemption signal on any rank (checked before the first step: nothing new to save); under a
        layer's rule, this process's own signal (no collective)."""
        return self.preempt.requested if self.agreed is not None else self._agree()[0]

    def after_step(self, step: int, last: bool) -> tuple[bool, bool]:
        preempted, timed = (self.agreed or self._agree)()
        return decide(step, last, self.every_steps, timed, preempted)

    def saved(self) -> None:
        self.last_save_t = time.monotonic()

    def interval_elapsed(self) -> bool:
        """The save interval in seconds has passed on this rank (the one rule; 0: off)."""
        return 0 < self.every_s <= time.monotonic() - self.last_save_t

    def _agree(self) -> tuple[bool, bool]:
        """(a signal on any rank, the save interval elapsed on any rank). Sync point: the flags are
        read on the host, once per step (it waits for the step's queued work on a GPU)."""
        flags = torch.tensor([float(self.preempt.requested), float(self.interval_elapsed())], device=self.device)
        return tuple((all_reduce_sum(flags) > 0).tolist())
