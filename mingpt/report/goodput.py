"""A job's time, from its metrics alone: where every second went, across restarts and world sizes.

The records (see mingpt.training.ledger): every process start writes "start", then "time" records at
every log, evaluation and save (cumulative seconds per state since the process started, the mean over
ranks), and surviving ranks 0 and 1 write "fault" when a peer fails. Nothing is written at a SIGKILL, so
the accounting of an attempt (the processes of one torchrun start) ends at its last record, and
the time until the next attempt's processes started is the restart ("down": failure detection,
torchrun's restart, and any work after the last record). Steps trained after the snapshot that a
later attempt resumed from were trained again: their time is "lost". Goodput is the step compute
of the steps kept, over the wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mingpt.training.ledger import STARTUP, STATES
from mingpt.training.metrics import read_records  # noqa: F401 - the report's reader

# the job's categories, in the order the report shows them
CATEGORIES = ("training", "lost", "down", "startup", "data_wait", "eval", "snapshot", "log", "regroup")
LABELS = {"training": "training, kept", "lost": "training, lost (steps trained again)",
          "down": "restart (detection to new processes)", "startup": "start-up", "data_wait": "waiting on data",
          "eval": "evaluation", "snapshot": "snapshot (blocking)", "log": "logging and records",
          "regroup": "replica groups: a new epoch formed, a group healed"}
STEP = ("step_data", "step_compute")


@dataclass
class Attempt:
    """The processes of one start of the job (one torchrun restart, or a new job)."""
    start: dict
    ledgers: list[dict] = field(default_factory=list)  # start, time and fault records, in order

    @property
    def t0(self) -> float:
        return self.start["t0"]

    @property
    def launch(self) -> str | None:
        """Which launch it belongs to (records of older versions name their rendezvous id only)."""
        return self.start.get("launch_id", self.start.get("job_id"))

    @property
    def first_step(self) -> int:
        return self.start["step"]

    @property
    def last(self) -> dict:
        return self.ledgers[-1]

    @property
    def end(self) -> float:
        """When the last record's figures were taken (its start plus its age)."""
        return self.t0 + sum(self.last["s"].values())

    @property
    def last_step(self) -> int:
        return self.last["step"]

    @property
    def startup_s(self) -> float:
        """From its processes' start to its first step done (its first record after the start's)."""
        first = self.ledgers[1] if len(self.ledgers) > 1 else self.ledgers[0]
        return sum(first["s"][p] for p in STARTUP)

    def seconds_at(self, step: int, state: str) -> float:
        """Cumulative seconds in `state` when `step` was done (interpolated between records where
        none was written at that step)."""
        points = [(r["step"], r["s"][state]) for r in self.ledgers]
        at = [v for s, v in points if s == step]
        if at:
            return at[0]
        below = [(s, v) for s, v in points if s < step]
        above = [(s, v) for s, v in points if s > step]
        if not below:
            return 0.0
        if not above:
            return below[-1][1]
        (s0, v0), (s1, v1) = below[-1], above[0]
        return v0 + (v1 - v0) * (step - s0) / (s1 - s0)


@dataclass
class Account:
    """Seconds per category over the whole job (CATEGORIES), start-up by phase, and per attempt."""
    wall: float
    seconds: dict[str, float]
    startup: dict[str, float]
    attempts: list[Attempt]
    lost_steps: list[int]
    gaps: list[float]  # per attempt: the restart before it (0 for the first of a job)

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall if self.wall > 0 else 0.0



def attempts_of(records: list[dict]) -> list[Attempt]:
    """The attempts that recorded their start-up (records of formats without ledgers are skipped)."""
    out: list[Attempt] = []
    for r in records:
        kind = r.get("kind")
        if kind == "start":
            out.append(Attempt(r))
            if "s" in r:
                out[-1].ledgers.append(r)
        elif kind in ("time", "fault") and out and "s" in r:
            out[-1].ledgers.append(r)
    return [a for a in out if a.ledgers]


def account(records: list[dict]) -> Account:
    """Where the job's wall time went. Attempts of one torchrun job are joined by their restarts;
    the time between two jobs (a new command) is not the job's and is left out."""
    attempts = attempts_of(records)
    if any(r.get("kind") == "epoch" for r in records):
        return account_replicas(records, attempts)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    startup = dict.fromkeys(STARTUP, 0.0)
    lost_steps, gaps, wall = [], [], 0.0
    for i, a in enumerate(attempts):
        # the steps of this attempt that no later attempt trained again
        later = [b.first_step for b in attempts[i + 1:]]
        kept_until = min([a.last_step, *later])
        s = a.last["s"]
        kept = {state: a.seconds_at(kept_until, state) if kept_until > a.first_step else 0.0 for state in STEP}
        seconds["training"] += kept["step_compute"]
        seconds["data_wait"] += kept["step_data"]
        seconds["lost"] += sum(s[state] - kept[state] for state in STEP)
        for phase in STARTUP:
            startup[phase] += s[phase]
            seconds["startup"] += s[phase]
        for state in ("eval", "snapshot", "log", "regroup"):
            seconds[state] += s.get(state, 0.0)  # records older than a state do not name it
        lost_steps.append(max(0, a.last_step - max(kept_until, a.first_step)))
        same_job = i > 0 and attempts[i - 1].launch == a.launch
        gap = max(0.0, a.t0 - attempts[i - 1].end) if same_job else 0.0
        gaps.append(gap)
        seconds["down"] += gap
        wall += gap + (a.end - a.t0)
    return Account(wall, seconds, startup, attempts, lost_steps, gaps)


def account_replicas(records: list[dict], attempts: list[Attempt]) -> Account:
    """A job of replica groups (mingpt.replicas): its groups start, die and rejoin while the others
    train, and the epoch's first member writes the job's records, so the job's time is the wall
    clock's, from the first process start to the last record. Training kept: the step time of every
    step the final weights descend from (the last train record of a step wins; a record covers the
    steps since the one before), at most the median step time. Regroup: the epochs' forming and healing. Start-up: the first start
    to the first epoch. Lost: the rest (steps dropped at faults, steps slowed while a group was away
    and the survivors trained its shares, snapshots, evaluation and logging)."""
    starts = [r["t0"] for r in records if r.get("kind") == "start" and "t0" in r]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    t0 = min(starts) if starts else min(r["time"] for r in epochs)
    wall = max(r["time"] for r in records if "time" in r) - t0
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    # a step slowed by a fault (the survivors train a lost group's shares too) counts at the median step time
    usual, previous = sorted(r["step_ms"] for r in train.values())[len(train) // 2] if train else 0.0, 0
    for step in sorted(train):
        seconds["training"] += min(train[step]["step_ms"], usual) / 1000 * (step - previous)
        previous = step
    seconds["regroup"] = sum(e["regroup_s"] for e in epochs[1:])
    seconds["startup"] = epochs[0]["time"] - t0
    seconds["lost"] = max(0.0, wall - seconds["training"] - seconds["regroup"] - seconds["startup"])
    startup = dict.fromkeys(STARTUP, 0.0)
    for a in attempts:
        for phase in STARTUP:
            startup[phase] += a.ledgers[0]["s"][phase] if a.ledgers else 0.0
    return Account(wall, seconds, startup, attempts, [0] * len(attempts), [0.0] * len(attempts))


def check_states() -> None:
    """The categories cover every ledger state exactly once (an import-time guard for new states)."""
    covered = set(STARTUP) | set(STEP) | {"eval", "snapshot", "log", "regroup"}
    assert covered == set(STATES), covered ^ set(STATES)


check_states()
