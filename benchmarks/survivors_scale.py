"""Replica groups by their number R: what each member costs (threads, sockets, memory, beacon traffic,
backward passes and gradient copies a step) and what forming an epoch and a SIGKILL cost, at R = 4, 8,
16 and 32 groups. Each group is one torchrun of one process of 1 thread, in its own CPU share where
the kernel allows (benchmarks/survivors.py's launching, shares and faults). One JSON line per R:

    python -m benchmarks survivors-scale [--groups 4 8 16 32] [--model gpt-nano] [--steps 150 | --seconds S]
        [--kill] [--kill-group 0] [--check-bitwise] [--spares] [--first-step-s 240] [--keep DIR]

Per member (median, max, and `max_member`: the group that holds the max; group 0 is the coordinator):
`threads`, `sockets` (its /proc/PID/fd links to sockets) and `rss_mb`, sampled once while training
(step SAMPLE_AT); `channels`, `beacon_msgs_per_s` and `beacon_bytes_per_s` from the line each
member's beacon logs at its close (the last incarnation's, with --kill); `passes` (shares a member
trained in a step: backward passes) and `grad_copies` (1 + the shares it trained that are not its
own), from the step records' `shares`, for a fault-free step and, with --kill, the step after the
kill. `first_epoch`: the first epoch's groups and its formation (`formed_s`, `links_s` over
its members, from their `replica epoch N: ...` lines; `first_whole_epoch` too where a group started
too late for the first); with --kill, `epoch_after_kill`: the same for
the survivors' epoch without the killed group, and `steps_lost_per_fault`, `fault_cost_s`,
`survivor_gap_s`, `new_epoch_s`, `rejoin_s` as survivors.py measures them. `step_s`: the median
interval between fault-free steps' commits. `--check-bitwise` also runs each R without the fault and
gives `final_max_abs_diff` (twice the time). A setting whose first step does not come within
--first-step-s prints that (with the epochs formed meanwhile), and the next R runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.survivors import REPO, Faults, final, measure, replicas_job
from mingpt.training.metrics import read_records

SAMPLE_AT = 10  # the step at which each member's threads, sockets and memory are sampled (before a kill)
BEACON = re.compile(r"replica beacon of group (\d+): (\d+) channels at the end; sent (\d+) messages \((\d+) bytes\) "
                    r"in ([\d.]+) s")
EPOCH = re.compile(r"replica epoch (\d+): groups \[([\d, ]*)\] \(this is group (\d+), rank (\d+)\), formed in "
                   r"([\d.]+) s \(its links ([\d.]+) s"
                   r"(?:; the last request, group (\d+)(?: process \d+)?'s, came ([\d.]+) s in)?(; formed by its beacon)?")


class NoFirstStep(RuntimeError):
    """A setting that did not reach its first step within its deadline."""


def beacon_lines(text: str) -> dict[int, dict]:
    """Each group's beacon figures from its log: the last `replica beacon of group G: ...` line (a
    killed incarnation logs none; its restart's is the one that ran to the end)."""
    out = {}
    for m in BEACON.finditer(text):
        g, channels, messages, size, seconds = int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5])
        out[g] = {"channels": channels, "msgs_per_s": messages / max(seconds, 1e-9),
                  "bytes_per_s": size / max(seconds, 1e-9)}
    return out


def epoch_lines(text: str) -> list[dict]:
    """The `replica epoch N: groups [...] (this is group G, rank r), formed in X s (its links Y s)` lines
    (the coordinator's adds `; the last request, group H's, came Z s in`: `last_request` [H, Z])."""
    return [{"number": int(m[1]), "groups": [int(g) for g in m[2].replace(" ", "").split(",") if g],
             "group": int(m[3]), "rank": int(m[4]), "formed_s": float(m[5]), "links_s": float(m[6]),
             "last_request": [int(m[7]), float(m[8])] if m[7] else None, "ahead": bool(m[9])}
            for m in EPOCH.finditer(text)]


def step_work(shares: list, groups: int) -> dict[int, tuple[int, int]]:
    """(backward passes, gradient copies) of each group that trained in a step, from its record's
    `shares` ([group that trained it, samples, ids] per share; share s is group s // k's, k shares a
    group): a pass per share trained; one copy for its own shares, one more per share of another's."""
    k = len(shares) // groups
    out: dict[int, tuple[int, int]] = {}
    for s, (g, _, _) in enumerate(shares):
        passes, copies = out.get(g, (0, 1))
        out[g] = (passes + 1, copies + (s // k != g))
    return out


def stat(by_member: dict[int, float], digits: int = 3, who: str = "max_member") -> dict | None:
    """Median and max over members, and the member holding the max (the lowest, on a tie), named `who`."""
    if not by_member:
        return None
    top = max(by_member, key=lambda m: (by_member[m], -m))
    return {"median": round(statistics.median(by_member.values()), digits), "max": round(by_member[top], digits),
            who: top}


def epoch_figures(lines: list[dict]) -> dict:
    """An epoch's groups and its formation over the members that logged it, when the last join request
    came to its coordinator (from the start of the coordinator's forming), and whether the coordinator's
    beacon formed it while its trainer finished a step (`formed_ahead`)."""
    last = next((e["last_request"] for e in lines if e["last_request"]), None)
    return {"number": lines[0]["number"], "groups": len(lines[0]["groups"]),
            "formed_s": stat({e["group"]: e["formed_s"] for e in lines}),
            "links_s": stat({e["group"]: e["links_s"] for e in lines}),
            "last_request": None if last is None else {"group": last[0], "came_s": last[1]},
            "formed_ahead": any(e["ahead"] for e in lines)}


def epochs_of(epochs: list[dict], killed: int | None, groups: int) -> dict:
    """The first epoch's figures (and the first of all `groups`'s, where a group started too late for
    the first), and with a kill those of the survivors' first epoch without the killed group (after
    one that held it)."""
    if not epochs:
        return {"first_epoch": None}
    first = min(e["number"] for e in epochs)
    out = {"first_epoch": epoch_figures([e for e in epochs if e["number"] == first])}
    if out["first_epoch"]["groups"] < groups:
        whole = min((e["number"] for e in epochs if len(e["groups"]) == groups), default=None)
        out["first_whole_epoch"] = epoch_figures([e for e in epochs if e["number"] == whole]) if whole is not None else None
    if killed is not None:
        held = [e["number"] for e in epochs if killed in e["groups"]]
        after = sorted({e["number"] for e in epochs if held and e["number"] > min(held) and killed not in e["groups"]})
        out["epoch_after_kill"] = (epoch_figures([e for e in epochs if e["number"] == after[0] and e["group"] != killed])
                                   if after else None)
    return out


def work_figures(train: list[dict], groups: int, t: float | None) -> dict:
    """Passes and gradient copies per member at a fault-free step (the last with every group before the
    kill at `t`, or the middle step without one) and at the step after the kill."""
    whole = [r for r in train if len(set(r.get("members", []))) == groups and r.get("shares")
             and (t is None or r["time"] <= t)]
    steps = {"fault_free": whole[-1] if t is not None else whole[len(whole) // 2]} if whole else {}
    later = [r for r in train if t is not None and r["time"] > t and r.get("shares")]
    if later:
        steps["after_kill"] = later[0]
    out = {"passes": {}, "grad_copies": {}}
    for name, r in steps.items():
        work = step_work(r["shares"], groups)
        out["passes"][name] = {"step": r["step"], **stat({g: p for g, (p, _) in work.items()})}
        out["grad_copies"][name] = {"step": r["step"], **stat({g: c for g, (_, c) in work.items()})}
    return out


def step_time(train: list[dict], t: float | None) -> float | None:
    """The median interval between commits of fault-free steps (before the kill at `t`; the first two left out)."""
    times = [r["time"] for r in train if t is None or r["time"] <= t][2:]
    return round(statistics.median(b - a for a, b in zip(times, times[1:])), 4) if len(times) > 2 else None


def proc_figures(pid: int) -> dict | None:
    """A process's threads, sockets and resident memory (MB) now; None once it has ended."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return {"threads": int(status["Threads"]), "sockets": sockets, "rss_mb": int(status["VmRSS"].split()[0]) / 1024}


class Watch(Faults):
    """survivors.py's faults (at most one SIGKILL, of group `kill_group`'s worker, once PACE_OF steps
    trained; none with `kill` False), plus: every member's process sampled once at step SAMPLE_AT, and
    NoFirstStep if no step comes within `first_step_s` of the launch."""

    def __init__(self, run_dir: Path, kill: bool, kill_group: int, first_step_s: float):
        super().__init__(1.0 if kill else 0, ("kill",), run_dir, max_faults=1)
        self.n, self.first_step_s, self.sample = kill_group, first_step_s, None

    def __call__(self, job, t0: float, ending: bool = False) -> list[dict]:
        if self.sample is None:
            metrics = self.run_dir / "metrics.jsonl"
            steps = metrics.read_text().count('"kind": "train"') if metrics.exists() else 0
            if not steps and time.time() - t0 > self.first_step_s:
                raise NoFirstStep(f"no step within {self.first_step_s:g} s of the launch")
            if steps >= SAMPLE_AT:
                got = {g: proc_figures(job.workers(g)[0]) for g in range(job.groups) if job.workers(g)}
                self.sample = {g: f for g, f in got.items() if f is not None}
        return super().__call__(job, t0, ending)


def setting(args, groups: int, run_dir: Path, kill: bool, ref: dict | None = None) -> dict:
    """One job of `groups` groups: its figures (NoFirstStep if it never trained)."""
    watch = Watch(run_dir, kill, args.kill_group, args.first_step_s)
    wall, done, isolation = replicas_job(args, run_dir, watch, groups=groups)
    train = sorted((r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "train"),
                   key=lambda r: r["time"])
    t = done[0]["t"] if done else None
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("console*.log")))
    beacons = beacon_lines(logs)
    sample = watch.sample or {}
    out = {"isolation": isolation, "faults": len(done), "step_s": step_time(train, t),
           **{k: stat({g: f[k] for g, f in sample.items()}, 1) for k in ("threads", "sockets", "rss_mb")},
           "channels": stat({g: b["channels"] for g, b in beacons.items()}, 1),
           "beacon_msgs_per_s": stat({g: b["msgs_per_s"] for g, b in beacons.items()}, 1),
           "beacon_bytes_per_s": stat({g: b["bytes_per_s"] for g, b in beacons.items()}, 0),
           **work_figures(train, groups, t), **epochs_of(epoch_lines(logs), done[0]["group"] if done else None, groups)}
    got = measure(run_dir, wall, done, ref, args.procs_per_group)
    keep = ["steps", "wall_s", *(["steps_lost_per_fault", "fault_cost_s", "survivor_gap_s", "new_epoch_s", "rejoin_s"]
                                 if done else []), *(["final_max_abs_diff"] if ref else [])]
    return {**out, **{k: got.get(k) for k in keep}}


def sized(args, groups: int, tmp: Path) -> int:
    """--seconds: the steps of that many seconds at this R, from a short fault-free run's step time."""
    probe = argparse.Namespace(**{**vars(args), "steps": 40, "spares": False})
    got = setting(probe, groups, tmp / f"groups{groups}-probe", kill=False)
    return max(60, round(args.seconds / got["step_s"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks survivors-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", nargs="+", type=int, default=[4, 8, 16, 32], help="the numbers of groups R to run")
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--steps", type=int, default=150, help="steps per setting (room for the kill at step 31 and the rejoin)")
    ap.add_argument("--seconds", type=float, default=0, help="instead of --steps: this many seconds of steps at each "
                                                             "R (a 40-step fault-free run measures its step first)")
    ap.add_argument("--kill", action="store_true", help="one SIGKILL of a group's worker once 30 steps trained")
    ap.add_argument("--kill-group", type=int, default=0, help="the group whose worker --kill takes (0: the coordinator)")
    ap.add_argument("--check-bitwise", action="store_true", help="also run each R without the fault: its final "
                                                                 "weights against the faulted run's")
    ap.add_argument("--spares", action="store_true", help="each group's command started twice, the second standing by")
    ap.add_argument("--first-step-s", type=float, default=240, help="a setting with no step by then is reported, not waited for")
    ap.add_argument("--limit-s", type=float, default=1800, help="a setting's whole job, at most")
    ap.add_argument("--corpus", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--no-isolation", dest="isolate", action="store_false", help="no CPU share per group")
    ap.add_argument("--keep", help="keep every job's run directory here")
    args = ap.parse_args(argv)
    if any(r < 2 for r in args.groups):
        ap.error(f"--groups {args.groups}: replica groups come 2 or more to a job")
    if args.kill and not 0 <= args.kill_group < min(args.groups):
        ap.error(f"--kill-group {args.kill_group}: a group of every setting, 0 to {min(args.groups) - 1}")
    if args.check_bitwise and not args.kill:
        ap.error("--check-bitwise compares a faulted run with a fault-free one: add --kill")
    # what survivors.replicas_job reads besides
    args.procs_per_group, args.shares_per_group, args.spare_cores, args.snapshot_every, args.set = 1, 0, 0.0, 50, []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still removes its cgroups
    base = {"model": args.model, "cpus": os.cpu_count(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory(prefix="mingpt-survivors-scale-") as scratch:
        tmp = Path(args.keep or scratch)
        for groups in args.groups:
            row = {**base, "groups": groups, "spares": args.spares,
                   "fault": f"SIGKILL of group {args.kill_group}'s worker" if args.kill else "none"}
            try:
                steps = sized(args, groups, tmp) if args.seconds else args.steps
                one = argparse.Namespace(**{**vars(args), "steps": steps})
                ref = None
                if args.check_bitwise:
                    clean = setting(one, groups, tmp / f"groups{groups}-none", kill=False)
                    ref = {"step_s": clean["step_s"], "weights": final(tmp / f"groups{groups}-none")}
                row.update(setting(one, groups, tmp / f"groups{groups}", args.kill, ref))
            except RuntimeError as e:  # (NoFirstStep, or a job that failed or ran past --limit-s)
                seen = []
                for d in sorted(tmp.glob(f"groups{groups}*")):
                    seen += epoch_lines("".join(p.read_text(errors="replace") for p in d.glob("console*.log")))
                row["error"] = str(e).splitlines()[0]
                row["epochs_formed"] = sorted({(e["number"], len(e["groups"])) for e in seen})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
