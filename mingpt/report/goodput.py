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
from pathlib import Path

from mingpt.training.ledger import STARTUP, STATES
from mingpt.training.metrics import read_records  # also the report's reader (its __main__)

# the job's categories, in the order the report shows them
CATEGORIES = ("training", "lost", "down", "startup", "data_wait", "eval", "snapshot", "log", "regroup", "other")
LABELS = {"training": "training, kept", "lost": "training, lost (steps trained again)",
          "down": "restart (detection to new processes)", "startup": "start-up", "data_wait": "waiting on data",
          "eval": "evaluation", "snapshot": "snapshot (blocking)", "log": "logging and records",
          "regroup": "replica groups: a new epoch formed, a group healed",
          "other": "other (replica groups: between the records)"}
STEP = ("step_data", "step_compute")
LEFT = "left the job (a stop signal)"  # the end of an epoch's `why` where groups left it (replica_trainer.py)


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
        """From its processes' start to its first step done (its first record after the start's). A replica
        group's start: to its start record, written once it joined an epoch and healed, every state of that
        record counted (its wait to be let in and its heal, "regroup", included), so its parts add up to it."""
        if "group" in self.start:
            return sum(self.start["s"].values())
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
    restarts: list[int] = field(default_factory=list)  # the attempts that are restarts (a process started again)
    t0: float = 0.0  # the job's first process start
    idle: list[tuple[float, float]] = field(default_factory=list)  # (from, to): between two jobs, not the job's
    replicas: bool = False
    faults: int = 0  # replica groups: the epochs formed because a group was lost (each lost its step in flight)
    lost_at: dict[int, float] = field(default_factory=dict)  # replica groups: per restart, when its group was lost

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall if self.wall > 0 else 0.0

    def clock(self, t: float) -> float:
        """Seconds of the job at wall time `t`, from its first start, the idle time between jobs left out:
        the time axis of every plot."""
        return t - self.t0 - sum(max(0.0, min(t, end) - start) for start, end in self.idle)


def attempts_of(records: list[dict]) -> list[Attempt]:
    """The attempts that recorded their start-up (records of formats without ledgers are skipped). A
    time or fault record belongs to the attempt whose processes started when it says (replica groups
    start apart, and their start records come after a heal), else to the last one started."""
    out: list[Attempt] = []
    by_t0: dict[float, Attempt] = {}
    for r in records:
        kind = r.get("kind")
        if kind == "start":
            out.append(Attempt(r))
            if "s" in r:
                out[-1].ledgers.append(r)
                by_t0[r["t0"]] = out[-1]
        elif kind in ("time", "fault") and out and "s" in r:
            by_t0.get(r["t0"], out[-1]).ledgers.append(r)
    return [a for a in out if a.ledgers]


def account(records: list[dict]) -> Account:
    """Where the job's wall time went. Attempts of one torchrun job are joined by their restarts;
    the time between two jobs (a new command) is not the job's and is left out."""
    attempts = attempts_of(records)
    if any(r.get("kind") == "epoch" for r in records):
        return account_replicas(records, attempts)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    startup = dict.fromkeys(STARTUP, 0.0)
    lost_steps, gaps, wall, restarts, idle = [], [], 0.0, [], []
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
        restarts += [i] if same_job else []
        idle += [(attempts[i - 1].end, a.t0)] if i > 0 and not same_job and a.t0 > attempts[i - 1].end else []
        seconds["down"] += gap
        wall += gap + (a.end - a.t0)
    return Account(wall, seconds, startup, attempts, lost_steps, gaps, restarts,
                   attempts[0].t0 if attempts else 0.0, idle)


def account_replicas(records: list[dict], attempts: list[Attempt]) -> Account:
    """A job of replica groups (mingpt.replicas): its groups start, die and rejoin while the others
    train, and the epoch's first member writes the job's records, so the job's time is the wall
    clock's, from the first process start to the last record. Training kept: the step time of every
    step the final weights descend from (the last train record of a step wins; a record covers the
    steps since the one before), a step slowed while a group was away included. Lost: the step in
    flight at each fault, at most one step. Regroup: the pause of the training between its last step
    before a new epoch and the epoch (a returning group's own wait to be let in is not the job's).
    Start-up: the first start to the first epoch. Evaluation, snapshots and logging: the recording
    member's. Other: the rest. A restart is a group started again (its torchrun's processes)."""
    starts = [r for r in records if r.get("kind") == "start" and "t0" in r]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    t0 = min(r["t0"] for r in starts) if starts else min(r["time"] for r in epochs)
    wall = max(r["time"] for r in records if "time" in r) - t0
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    previous = 0
    for step in sorted(train):
        seconds["training"] += train[step]["step_ms"] / 1000 * (step - previous)
        previous = step
    usual = sorted(r["step_ms"] for r in train.values())[len(train) // 2] / 1000 if train else 0.0
    seconds["regroup"], seconds["lost"], faults = _pauses(records, usual)
    seconds["startup"] = epochs[0]["time"] - t0
    seconds.update(_recorded(records, ("eval", "snapshot", "log")))
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    # every process of a group writes a start record: a start of the group is one of its torchrun's (its
    # job id and restart count), told by its first process; a restart, a group started again
    starts_of = {}
    for a in attempts:
        starts_of.setdefault((a.start.get("group"), a.start.get("job_id"), a.start.get("restart")), a)
    attempts = list(starts_of.values())
    startup = dict.fromkeys(STARTUP, 0.0)
    for a in attempts:
        for phase in STARTUP:
            startup[phase] += a.ledgers[0]["s"][phase] if a.ledgers else 0.0
    # a group started again is a restart, unless it had left the job on a stop signal (a resume, as a job's
    # after Ctrl-C); torchrun's count too: a process killed as it joined wrote no start
    last, restarts, lost_at = {}, [], {}
    for i, a in enumerate(attempts):
        group = a.start.get("group")
        gone = _gone(epochs, group, last.get(group, float("-inf")), a)
        if a.start.get("restart", 0) > 0 or (group in last and not (gone and gone["why"].endswith(LEFT))):
            restarts.append(i)
            lost_at[i] = gone["time"] if gone else a.t0
        last[group] = a.start["time"]
    return Account(wall, seconds, startup, attempts, [0] * len(attempts), [0.0] * len(attempts), restarts, t0,
                   replicas=True, faults=faults, lost_at=lost_at)


def group_of(member: int, epoch: dict) -> int:
    """A member's group (members g * procs + i)."""
    return member // epoch.get("procs", 1)


def _gone(epochs: list[dict], group: int, since: float, attempt: Attempt) -> dict | None:
    """The first epoch without `group` after its start at `since` and before `attempt` (its next start)
    took an epoch: the other groups trained on without it from then."""
    return next((e for e in epochs if since < e["time"] <= attempt.t0 + attempt.startup_s
                 and group not in {group_of(m, e) for m in e.get("members", [])}), None)


def figures(run_dir: str | Path) -> dict[str, float]:
    """The job's goodput in a few numbers, from run_dir's metrics (what an experiment tracker gets at the
    end): goodput, wall seconds, seconds per category and the restarts."""
    acc = account(read_records(Path(run_dir) / "metrics.jsonl"))
    return {"goodput": round(acc.goodput, 4), "wall_s": round(acc.wall, 3), "restarts": len(acc.restarts),
            **{f"{category}_s": round(seconds, 3) for category, seconds in acc.seconds.items()}}


def _pauses(records: list[dict], usual: float) -> tuple[float, float, int]:
    """(regroup seconds, seconds of the steps in flight lost, faults) of a replica job. At every epoch
    after the first the training paused, from its last step done (its last train record, plus `usual`
    per step not logged since) to the epoch formed. At a fault (an epoch formed for another reason
    than a start or a join) the step in flight, at most one step, was dropped: the rest was the regroup."""
    regroup = lost = 0.0
    faults, last, first = 0, None, True
    for r in records:
        if r.get("kind") == "train":
            last = r
        elif r.get("kind") == "epoch" and first:
            first = False
        elif r.get("kind") == "epoch":
            pause = (r["time"] - last["time"] - usual * max(0, r["step"] - last["step"]) if last is not None
                     else r["regroup_s"])
            if r["why"] == "start":  # written by a returning group, whose regroup_s is its own wait to join
                regroup += max(0.0, pause)
            elif r["why"] == "a group joins" or r["why"].endswith(LEFT):  # at a step boundary: nothing dropped
                regroup += max(0.0, min(pause, r["regroup_s"]))
            else:
                faults += 1
                in_flight = min(usual, max(0.0, pause - r["regroup_s"]))
                lost += in_flight
                regroup += max(0.0, min(pause - in_flight, r["regroup_s"]))
    return regroup, lost, faults


def _recorded(records: list[dict], states: tuple[str, ...]) -> dict[str, float]:
    """Seconds in `states` of the member that wrote the time records, summed between each two of its
    records in a row (the recording member changes when the lowest group is lost or returns)."""
    out, last = dict.fromkeys(states, 0.0), None
    for r in records:
        if r.get("kind") == "time" and "s" in r:
            if last is not None and last["t0"] == r["t0"]:
                for state in states:
                    out[state] += max(0.0, r["s"].get(state, 0.0) - last["s"].get(state, 0.0))
            last = r
    return out


def check_states() -> None:
    """The categories cover every ledger state exactly once (an import-time guard for new states)."""
    covered = set(STARTUP) | set(STEP) | {"eval", "snapshot", "log", "regroup"}
    assert covered == set(STATES), covered ^ set(STATES)


check_states()
