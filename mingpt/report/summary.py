"""The one-screen text summary of a run, from its metrics file (no plotting library needed)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from mingpt.report.goodput import CATEGORIES, LABELS, LEFT, Account, account

PHASES = {"launch": "launch", "config": "config", "process_group": "process group", "preflight": "preflight",
          "data_load": "data", "model": "model", "restore": "restore", "first_step": "first step"}


@dataclass
class Run:
    """What the report shows, derived from the records once."""
    records: list[dict]
    account: Account
    train: dict[int, dict]  # step -> its last train record (a step trained again is logged again)
    evals: dict[int, dict]
    snapshots: list[dict]
    logged: list[tuple[dict, list[tuple[str, float]]]]  # every train record in file order, with its compute_of

    @classmethod
    def of(cls, records: list[dict]) -> Run:
        train, evals, snapshots, logged, current = {}, {}, [], [], []
        for r in records:
            kind = r.get("kind")
            if kind == "start":
                current = r.get("hosts") or []
            elif kind == "train":
                train[r["step"]] = r
                logged.append((r, compute_of(r, current)))
            elif kind == "eval":
                evals[r["step"]] = r
            elif kind == "snapshot":
                snapshots.append(r)
        return cls(records, account(records), dict(sorted(train.items())), dict(sorted(evals.items())), snapshots,
                   logged)

    def slowest(self, top: int = 3) -> list[tuple[str, float, float]]:
        """(rank or replica group, share of logged steps where it was the slowest, its mean compute time
        over the step's median), slowest first."""
        ratios, slowest, steps = defaultdict(list), defaultdict(int), 0
        for _, pairs in self.logged:
            if len(pairs) < 2:
                continue
            steps += 1
            names, compute = zip(*pairs)
            median = max(float(np.median(compute)), 1e-9)
            for name, c in pairs:
                ratios[name].append(c / median)
            slowest[names[int(np.argmax(compute))]] += 1
        rows = [(h, slowest[h] / steps, float(np.mean(v))) for h, v in ratios.items()]
        return sorted(rows, key=lambda row: (-row[2], -row[1]))[:top]


def compute_of(r: dict, hosts: list[str]) -> list[tuple[str, float]]:
    """A train record's compute milliseconds by who computed them: every replica group's (the groups of
    the epoch, one row each; its ranks' own are the leading group's only), else every rank's, named as
    its start record names them (`hosts`, of the same world size: none where they do not match)."""
    if "group_compute_ms" in r:
        return [(f"group {g}", ms) for g, ms in r["group_compute_ms"]]
    compute = r.get("compute_ms") or []
    return list(zip(hosts, compute)) if len(hosts) == len(compute) else []


def _s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _starts(run: Run) -> list[str]:
    """The starts line: how many, the restarts among them (Account.restarts, as the plots mark them), the
    jobs or replica groups, the world sizes; and the replica epochs."""
    acc, attempts = run.account, run.account.attempts
    sizes = [a.start["world_size"] for a in attempts]
    changes = [str(sizes[0])] + [str(b) for a, b in zip(sizes, sizes[1:]) if a != b]
    n, layout = len(acc.restarts), attempts[-1].start.get("parallel", "")
    if acc.replicas:  # a start's world is its group's torchrun: the job is the groups, replicas of each other
        groups = len({a.start.get("group") for a in attempts})
        whose = f"{n} restart{'s' * (n != 1)}, {groups} group{'s' * (groups != 1)}"
        inside = f", {layout} inside each" if layout not in ("", "single") else ""
        world = f"{' -> '.join(changes)} process{'es' * (sizes[-1] != 1)} per group{inside}, replicas across the groups"
    else:
        jobs = len(attempts) - n
        whose = f"{n} restart{'s' * (n != 1)}, {jobs} job{'s' * (jobs != 1)}"
        world = f"world size {' -> '.join(changes)}   {layout}"
    lines = [f"  starts {len(attempts)} ({whose})   {world}"]
    epochs = [r for r in run.records if r.get("kind") == "epoch"]
    if epochs:  # replica groups: every process start is a group's, and the groups trained through faults
        # a group heals whole: its processes (members g * procs + i) count once
        healed = sum(len({m // e.get("procs", 1) for m in e.get("healed", [])}) for e in epochs)
        left = sum(e["why"].endswith(LEFT) for e in epochs)
        lines.append(f"  replica groups: {len(epochs)} epochs, {acc.faults} lost a group (each lost at most its step "
                     f"in flight), {healed} group(s) healed from a peer"
                     + (f", groups left {left} time(s) on a stop signal" if left else ""))
    return lines


def _time_lines(run: Run, acc) -> list[str]:
    """Goodput, where the rest of the wall time went (a bar per category) and start-up by phase."""
    lines = []
    lines.append(f"  goodput {100 * acc.goodput:.1f}% of {_s(acc.wall)} wall time")
    replicas = any(r.get("kind") == "epoch" for r in run.records)
    shown = [c for c in CATEGORIES if replicas or c not in ("regroup", "other")]  # replica jobs' own lines
    width = max(len(LABELS[c]) for c in shown)
    for c in shown:
        v = acc.seconds[c]
        share = v / acc.wall if acc.wall else 0.0
        bar = "#" * round(30 * share)
        lines.append(f"    {LABELS[c]:<{width}} {_s(v):>9} {100 * share:5.1f}% {bar}")
    phases = " | ".join(f"{PHASES[p]} {acc.startup[p]:.1f}" for p in PHASES if acc.startup[p] >= 0.05)
    lines.append("    start-up by phase, all starts (s):")
    lines.append(f"      {phases}")
    return lines


def _restart_lines(acc) -> list[str]:
    """The last few restarts: a replica group's (it healed) and the job's (down, start-up, steps again)."""
    lines, attempts = [], acc.attempts
    restarts = [(i, a) for i, a in enumerate(attempts) if acc.gaps[i] > 0]
    if acc.replicas and acc.restarts:
        lines.append("")
        lines.append("  restarts (a group's processes started again; they healed from a live group):")
        for i in acc.restarts[-5:]:
            a = attempts[i]
            # where its return went, by the start record's ledger (written once it joined and healed): every
            # state of it, as the start-up shown is their sum (Attempt.startup_s); those under 0.05 s together
            shown = {k: v for k, v in a.start["s"].items() if v >= 0.05}
            rest = a.startup_s - sum(shown.values())
            parts = " | ".join([f"{PHASES.get(k, 'joining and healing' if k == 'regroup' else k)} {v:.1f}"
                                for k, v in shown.items()] + ([f"the rest {rest:.1f}"] if rest >= 0.05 else []))
            lines.append(f"    group {a.start.get('group')}: back at step {a.first_step:,}, start-up {a.startup_s:.1f} s"
                         + (f" ({parts})" if parts else ""))
    if restarts:
        lines.append("")
        lines.append("  restarts (from the last record before it to the first step after it):")
        for i, a in restarts[-5:]:
            prev = attempts[i - 1]
            lines.append(f"    at step {prev.last_step:,} (world {prev.start['world_size']} -> "
                         f"{a.start['world_size']}): down {acc.gaps[i]:.1f} s, start-up {a.startup_s:.1f} s, resumed "
                         f"at step {a.first_step:,}, {acc.lost_steps[i - 1]} step(s) trained again")
        if len(restarts) > 5:
            lines.append(f"    ... and {len(restarts) - 5} earlier")
    return lines


def _snapshot_lines(run: Run) -> list[str]:
    """Snapshots committed, failed and retried; how long saving blocked the loop."""
    if not run.snapshots:
        return []
    done = [s for s in run.snapshots if s["status"] == "committed"]
    failed = sum(s["status"] == "failed" for s in run.snapshots)
    retries = sum(s["status"] == "retry" for s in run.snapshots)
    line = f"  snapshots: {len(done)} committed, {failed} failed, {retries} retried attempt(s)"
    if done:
        line += (f"; blocking {1000 * np.mean([s['blocking_s'] for s in done]):.0f} ms, committed "
                 f"{np.mean([s['total_s'] for s in done]):.2f} s after the copy (means)")
    return ["", line]


def summary(run: Run, name: str) -> str:
    """The text a person reads first: progress, restarts, goodput and where the rest went."""
    acc, lines = run.account, []
    attempts = acc.attempts
    lines.append(f"run {name}")
    if run.train:
        last = run.train[max(run.train)]
        step = max(r["step"] for r in run.records if "step" in r)  # a save or a stop after the last logged step
        lines.append(f"  steps {step:,}   " + ("" if step == last["step"] else f"last logged step {last['step']:,}: ")
                     + f"tokens {last.get('tokens_seen', 0):,}   last train loss {last['loss']:.4f}")
    if run.evals:
        best = min(run.evals.values(), key=lambda r: r["val_loss"])
        lines.append(f"  best val loss {best['val_loss']:.4f} at step {best['step']:,}")
    if not attempts:
        lines.append("  no time records (a run of an older version?): no goodput")
        return "\n".join(lines)
    lines += _starts(run)
    lines.append("")
    lines += _time_lines(run, acc) + _restart_lines(acc)
    slow = run.slowest()
    if slow:
        lines.append("")
        lines.append("  slowest ranks (step compute against the step's median):")
        for host, share, ratio in slow:
            lines.append(f"    {host:<20} {ratio:.2f}x median, slowest in {100 * share:.0f}% of logged steps")
    lines += _snapshot_lines(run)
    return "\n".join(lines)
