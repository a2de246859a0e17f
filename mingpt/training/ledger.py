"""Where a process's wall time goes: a clock that is always in exactly one state.

From the moment the process started (read from /proc, so the interpreter's start and the imports
count) every second is added to one state, so the states of a process add up to its age. The
Trainer's records carry the cumulative figures (the mean over ranks) at every log, evaluation and
save, so a SIGKILLed process leaves its accounting up to its last record; `mingpt.report` sums the
records of all restarts into the job's goodput. Imports nothing heavy: main.py starts it first.
"""

from __future__ import annotations

import contextlib
import os
import time

# start-up, in order, then the states of steady training
STARTUP = ("launch", "config", "process_group", "preflight", "data_load", "model", "restore", "first_step")
STEADY = ("step_data", "step_compute", "eval", "snapshot", "log", "regroup")  # regroup: replica groups (mingpt.replicas)
STATES = STARTUP + STEADY
STEP_STATES = ("step_data", "step_compute")


def process_start_epoch(pid: int | str = "self") -> float:
    """When this process started, in seconds since the epoch (10 ms resolution; now where /proc is
    missing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Ledger:
    """Cumulative seconds per state since the process started. `switch` moves to another state;
    until `started()` (the first step done), the step states count as "first_step"."""

    def __init__(self, start_epoch: float | None = None):
        self.start_epoch = start_epoch if start_epoch is not None else process_start_epoch()
        self.seconds = dict.fromkeys(STATES, 0.0)
        self.state = "launch"
        self.steady = False
        # the monotonic clock's reading when the process started
        self._since = time.monotonic() - max(0.0, time.time() - self.start_epoch)

    def begin_again(self) -> None:
        """A replica's spare takes its member's place (mingpt/replicas/standby.py): its start counts from
        now, its build and its wait before were no start-up of the job's."""
        self.__init__(time.time())

    def switch(self, state: str) -> str:
        """Charge the time since the last switch to the current state, enter `state`; returns the
        state left."""
        if not self.steady and state in STEP_STATES:
            state = "first_step"
        now = time.monotonic()
        self.seconds[self.state] += now - self._since
        left, self.state, self._since = self.state, state, now
        return left

    @contextlib.contextmanager
    def during(self, state: str):
        """Charge a block to `state`, then go back to the state before it."""
        left = self.switch(state)
        try:
            yield
        finally:
            self.switch(left)

    def started(self) -> None:
        """The first step is done: from now on steps count as steps."""
        self.switch("log")
        self.steady = True

    def record(self, write, step: int, gather=None, kind: str = "time", **extra) -> None:
        """Write the cumulative figures as a record: the mean over ranks where `gather` collects
        every rank's (a collective), else this process's own."""
        here = [self.start_epoch, *self.totals()]
        write({"kind": kind, "step": step, **extra, **mean_record(gather(here) if gather else [here])})

    def step_seconds(self) -> float:
        """Seconds spent in steps so far (the first one included)."""
        totals = dict(zip(STATES, self.totals()))
        return totals["first_step"] + sum(totals[s] for s in STEP_STATES)

    def totals(self) -> list[float]:
        """Seconds per state (in STATES order) up to now, the open interval included."""
        out = dict(self.seconds)
        out[self.state] += time.monotonic() - self._since
        return [out[s] for s in STATES]


def mean_record(gathered: list[list[float]]) -> dict:
    """The record fields of every rank's [start epoch, *totals]: the mean start and the mean
    seconds per state (each rank's add up to its age, so the means add up to the mean age)."""
    n = len(gathered)
    starts = [g[0] for g in gathered]
    return {"t0": round(sum(starts) / n, 3),
            "s": {state: round(sum(g[i + 1] for g in gathered) / n, 4) for i, state in enumerate(STATES)}}
