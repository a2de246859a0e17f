"""Survivors keep training: a job of 3 replica groups (mingpt.replicas, each group its own torchrun of
one process, or of --procs-per-group) on this machine, each group in its own CPU share (a cgroup of
cores / 3, its restarts included, as if on a node of its own: benchmarks/cpushare.py; the JSON's
`isolation` says whether the kernel allowed it). Faults: one group's worker SIGKILLed every T
seconds (the groups in turn, the coordinator included; torchrun restarts it and it heals from a live
peer); then a row for each other kind (--kinds): a worker frozen (SIGSTOP for --hold-s, then
SIGCONT), a group's agent SIGKILLed with its worker and relaunched (a node lost), two groups SIGKILLed
at once (the third waits without a quorum), every group SIGKILLed (back from the newest snapshot);
and a network partition (each group in its own network namespace on one bridge; one group's link
cut for --cut-s seconds). `--soak N` runs only a soak: N faults of all these kinds drawn at random
(--seed), --soak-every s apart, in one job, against the fault-free run. `--spares` starts each group's
command twice (the second stands by: mingpt/replicas/standby.py); with `--spare-cores C`, C cores
are kept beside the groups' shares (theirs cut from the rest, in every mode) and each group's spare,
standing by or starting up, runs there, its member in the group's share: a GPU node's idle cores,
where the restarted process that becomes the next spare does not slow the member training.
Beside it, the same 3 groups through torchft 0.2.0's Manager (its lighthouse, `Manager.allreduce`,
`should_commit`, healing by its own transport; benchmarks/torchft_worker.py; skipped where torchft
is not installed; a CPU share per group too), and the same job under today's single torchrun (3
workers, DDP, restarted from a snapshot every 5 steps; one share of all the groups' cores). One
JSON line per setting:

    python -m benchmarks survivors [--kill-every 60 30 15] [--kinds freeze agent two all] [--kind-every 30]
        [--steps 600] [--model gpt-mini] [--keep DIR] [--no-replicas] [--no-torchft] [--no-restart-baseline]
        [--no-isolation] [--cut-s 0] [--shares-per-group K] [--procs-per-group N] [--seconds S] [--spares [--spare-cores C]]
        [--set KEY=VALUE ...] [--soak N --soak-every 4 --seed 0]

goodput: steps x the fault-free run's median step time / wall time (launch to exit); batch_goodput:
the same with each step counted by the share of the global batch it trained (torchft's steps while a
group is away train the survivors' shares only; mingpt's are always whole);
survivor_gap_s: a fault to the next step committed (median, max; that step is the one in flight,
trained again, with the lost group's shares split among the survivors); new_epoch_s: a fault to the survivors'
new epoch (detection and forming); steps_lost_per_fault: steps whose
compute was thrown away (the step in flight, and for a restart the steps since the snapshot);
rejoin_s: the fault to the first step committed with the faulted group back in (torchft: the
group's own first commit after its restart); rejoin_parts_s: where a restarted group's rejoin went
(medians: the restart, then its process's ledger, then waiting for its first step); by_kind: the
same per fault kind, where a run mixes them; fault_cost_s: what each fault cost the job, from the
steps around it (the time from the last step before it to the last step 2 s after its group is back,
less those steps at the pace of the 30 before it: a machine's drift in speed over a run stays out);
lost_to_faults: their sum over the wall time; final_max_abs_diff: final weights against the
fault-free run of the same mode (and, on its own line, the fault-free replica run against today's
DDP run with the same global batch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import children, die_with_bench, free_port, free_port_runs
from benchmarks.cpushare import CpuShares
from benchmarks.netns import NoNamespaces, bridged_nodes
from mingpt.replicas.standby import lock_path
from mingpt.runtime.trust import job_secret
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest
from mingpt.training.metrics import read_records

REPO = Path(__file__).resolve().parents[1]
SECRET = secrets.token_hex(32)  # the same for every group of one bench run
GROUPS = 3
PACE_OF = 30  # the steps before a fault whose pace its cost is measured against


def job_args(model: str, steps: int, run_dir: Path, corpus: str, snapshot_every: int, extra=()) -> list[str]:
    return ["-m", "mingpt.main", f"model={model}", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.eval_every=0", f"snapshot.every_steps={snapshot_every}", f"trainer.run_dir={run_dir}",
            f"data.path={corpus}", "trainer.progress=false", "trainer.threads=1", *extra]


def torchrun(nproc: int, prefix: list[str] = ()) -> list[str]:
    return [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max-restarts=1000", "--monitor-interval=0.2"]


class Job:
    """The agents of one job, each started in its group's CPU share (benchmarks/cpushare.py); a fault
    may SIGKILL an agent with its processes and `relaunch` it (its console log goes on). Agents past
    the first `groups` are the groups' second torchruns (--spares: agent i is group i % groups's)."""

    def __init__(self, cmds: list[tuple[list[str], dict]], run_dir: Path, shares: CpuShares | None, groups: int):
        self.cmds, self.run_dir, self.shares, self.groups = cmds, run_dir, shares, groups
        self.agents = [self._start(i) for i in range(len(cmds))]
        self.placed: dict[int, int | None] = {}  # where place() last put each worker
        # with --spares, each group's member lock (mingpt/replicas/standby.py), found once: asked every 20 ms
        secret = job_secret({"MINGPT_JOB_SECRET": SECRET})
        self.locks = [lock_path(secret, g) for g in range(groups)] if len(cmds) > groups else []

    def place(self) -> None:
        """With spares and cores beside the groups' shares: each group's member (its lock's holder) in the
        group's share, its other processes (the spare standing by, a restarted one starting up) beside."""
        if not self.shares or not self.shares.beside or len(self.agents) == self.groups:
            return
        held, _ = proc_locks()
        for g in range(self.groups):
            pids = self.workers(g, held)
            if len(pids) < 2 or pids[0] != held.get(self.inode(g)):
                continue  # no member yet: the group's processes stay where they started
            for pid in pids:
                where = g if pid == pids[0] else None
                if self.placed.get(pid, -1) != where and self.shares.move(pid, where):
                    self.placed[pid] = where

    def spares_ready(self) -> bool:
        """Whether each group's spare stands by (waits on its member's lock); True without spares."""
        return len(self.agents) == self.groups or {self.inode(g) for g in range(self.groups)} <= proc_locks()[1]

    def inode(self, g: int) -> str | None:
        """Group g's member lock's inode, once its file exists."""
        with contextlib.suppress(FileNotFoundError):
            return str(self.locks[g].stat().st_ino)
        return None

    def workers(self, g: int, held: dict[str, int] | None = None) -> list[int]:
        """Group g's worker processes, of both its torchruns with --spares; the member's first."""
        pids = [p for i in range(g, len(self.agents), self.groups) for p in children(self.agents[i].pid)]
        if len(self.agents) == self.groups:
            return pids
        holder = (held if held is not None else proc_locks()[0]).get(self.inode(g))
        return sorted(pids, key=lambda p: p != holder)

    def _start(self, i: int) -> subprocess.Popen:
        # a spare's torchrun beside the groups' shares where there are cores for it (its processes start there)
        spare = i >= self.groups and self.shares and self.shares.beside
        enter = self.shares.enter(None if spare else i % self.groups) if self.shares else (lambda: None)

        def preexec() -> None:
            enter()
            die_with_bench()
        cmd, env = self.cmds[i]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.run_dir / f"console{i}.log", "a"),
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)

    def kill_agent(self, i: int) -> None:
        """The whole group: its agent and every process of its session, at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agents[i].pid, signal.SIGKILL)
        self.agents[i].wait()

    def relaunch(self, i: int) -> None:
        self.agents[i] = self._start(i)


def proc_locks() -> tuple[dict[str, int], set[str]]:
    """The flocks in /proc/locks (a member's lock: mingpt/replicas/standby.py): the holder's pid by the
    file's inode, and the inodes a process waits on (a blocked lock: "->")."""
    held, waited = {}, set()
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.replace("->", "").split()
        if len(f) > 5 and f[1] == "FLOCK":
            inode = f[5].rsplit(":", 1)[-1]
            if "->" in line:
                waited.add(inode)
            else:
                held[inode] = int(f[4])
    return held, waited


def lock_holder(path: Path) -> int | None:
    """The process holding the flock on `path`."""
    return proc_locks()[0].get(str(path.stat().st_ino))


def run(cmds: list[tuple[list[str], dict]], run_dir: Path, faults, limit_s: float, ended=None,
        isolate: bool = True, shares_of: int | None = None, beside: float = 0.0) -> tuple[float, list, str]:
    """Start every agent, each in its own CPU share (`isolate`; `shares_of`: the shares to cut the
    cores into, by default one per agent; `beside`: cores kept out of them for the spares), run
    `faults(job, t0)` until they all exit (or, with `ended`, until it is true: the agents still running
    5 s later are stopped); (wall s, what faults did, the isolation)."""
    groups = shares_of or len(cmds)
    with CpuShares(groups, beside=beside) if isolate else contextlib.nullcontext() as shares:
        wall, done = _run(cmds, run_dir, faults, limit_s, ended, shares, groups)
    return wall, done, shares.isolation if shares else "none (--no-isolation): the groups share the machine's cores"


def _run(cmds, run_dir: Path, faults, limit_s: float, ended, shares: CpuShares | None, groups: int) -> tuple[float, list]:
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    job = Job(cmds, run_dir, shares, groups)
    done, end = [], None
    try:
        while any(a.poll() is None for a in job.agents) or (faults is not None and faults.busy()):
            if time.time() - t0 > limit_s:
                raise RuntimeError(f"the job did not finish in {limit_s:.0f} s (see {run_dir}/console*.log)")
            if end is None and ended is not None and ended():
                end = time.time()
            if end is not None and time.time() - end > 5:
                break
            if faults is not None:
                done.extend(faults(job, t0, ending=end is not None))
            job.place()
            time.sleep(0.02)
    finally:
        for a in job.agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        if faults is not None:
            faults.undo()
    wall = (end or time.time()) - t0
    codes = [a.returncode for a in job.agents if end is None or a.returncode >= 0]
    if any(codes):
        logs = "\n".join((run_dir / f"console{i}.log").read_text()[-2000:] for i in range(len(job.agents)))
        raise RuntimeError(f"the job failed ({codes}):\n{logs}")
    return wall, done


KINDS = ("kill", "freeze", "agent", "partition", "two", "all")
KIND_NAMES = {"kill": "SIGKILL", "freeze": "SIGSTOP then SIGCONT", "agent": "the agent SIGKILLed and relaunched",
              "partition": "a link cut", "two": "two groups SIGKILLed", "all": "every group SIGKILLed"}


class Faults:
    """A fault every `every` s once the job trains (at most `max_faults`; 0: no limit): `kinds` in turn,
    or drawn at random from them with `seed` (the soak); the groups in turn. What is undone later (a
    frozen worker's SIGCONT after `hold_s`, a cut link mended) waits in `pending`. Without `groups`
    (the single torchrun) a fault is a SIGKILL of one of its workers."""

    def __init__(self, every: float, kinds=("kill",), run_dir: Path | None = None, groups: bool = True,
                 max_faults: int = 0, seed: int | None = None, bridge=None, hold_s: float = 3.0):
        self.every, self.kinds, self.run_dir, self.groups = every, tuple(kinds), run_dir, groups
        self.max_faults, self.bridge, self.hold_s = max_faults, bridge, hold_s
        self.rng = random.Random(seed) if seed is not None else None
        self.next, self.n, self.training = every, 0, False
        self.pending: list[tuple[float, object]] = []

    def busy(self) -> bool:
        return bool(self.pending)

    def undo(self, all_of_them: bool = True) -> None:
        now = time.time()
        for due, action in list(self.pending):
            if all_of_them or due <= now:
                self.pending.remove((due, action))
                with contextlib.suppress(ProcessLookupError, subprocess.CalledProcessError):
                    action()

    def __call__(self, job: Job, t0: float, ending: bool = False) -> list[dict]:
        self.undo(all_of_them=ending)
        codes = [a.poll() for a in job.agents]
        if 0 in codes or None not in codes:  # the run finished (an agent is done with it) or the job is over: only
            return []  # undo what is pending (a fault now measures nothing; and a worker killed each time it
            # restarted, every 10 s on a slow machine, never got to the end: the bench ran on to its limit)
        if ending or not self.every or time.time() - t0 < self.next or (self.max_faults and self.n >= self.max_faults):
            return []
        if not self.training:  # a fault during the start-up tells nothing of survivors: wait for the steps
            # that set the pace its cost is measured against (and with spares, for each group's spare to
            # stand by: a fault at 3 a.m. finds them ready)
            self.training = job.spares_ready() and max(  # (torchft: a file per group)
                [m.read_text().count('"kind": "train"') for m in self.run_dir.glob("metrics*.jsonl")], default=0) > PACE_OF
            if not self.training:
                return []
        kind = self.rng.choice(self.kinds) if self.rng else self.kinds[self.n % len(self.kinds)]
        count = job.groups
        workers = {g: job.workers(g) for g in range(count)}
        if not self.groups:
            groups = [0]
        elif kind in ("all", "two"):
            groups = list(range(count)) if kind == "all" else [self.n % count, (self.n + 1) % count]
        else:  # the next group in turn that has a worker to fault (one may still be restarting)
            groups = [g for g in [(self.n + i) % count for i in range(count)] if workers[g] or kind == "agent"][:1]
        if not groups or (kind != "agent" and not any(workers[g] for g in groups)):
            return []  # every worker restarting: try again shortly
        self.next = time.time() - t0 + self.every  # faults `every` s apart, also after a long start-up
        t = time.time()
        if kind == "agent":
            job.kill_agent(groups[0])
            job.relaunch(groups[0])
        elif kind == "partition":
            node = self.bridge.nodes[groups[0]]
            self.bridge.cut(node)
            self.pending.append((t + self.hold_s, lambda: self.bridge.mend(node)))
        else:
            for g in groups:
                if not self.groups:  # the single torchrun: its workers in turn
                    victims = [workers[0][self.n % len(workers[0])]] if workers[0] else []
                else:  # one process of the group (its torchrun restarts them all), or the whole group
                    victims = workers[g][:1] if kind in ("kill", "freeze") else workers[g]
                for victim in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
                    if kind == "freeze":
                        self.pending.append((t + self.hold_s, lambda v=victim: os.kill(v, signal.SIGCONT)))
        self.n += 1
        return [{"t": t, "kind": kind, "groups": groups if self.groups else None,
                 "group": groups[0] if self.groups and len(groups) == 1 else None}]


def killer(every: float, groups: bool, run_dir: Path, max_kills: int = 0) -> Faults:
    """SIGKILL a worker every `every` s: the groups' workers in turn (replicas), or a worker of the one agent."""
    return Faults(every, ("kill",), run_dir, groups, max_kills)


def final(run_dir: Path) -> dict:
    ends = sorted(run_dir.glob("final-*.pt"))  # torchft's groups
    if ends:
        return torch.load(ends[0], weights_only=True)
    state, _ = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    return state["model"]


REJOIN_STATES = ("launch", "config", "process_group", "preflight", "data_load", "model", "restore", "regroup")


def rejoined(f: dict, epochs: list, train: list, recs: list, starts: list, procs: int) -> float | None:
    """When the faulted groups were back: the first step committed with every member of them again,
    after an epoch without them (a freeze shorter than the detection never left); torchft: the
    restarted group's own first commit. None if they never left or never came back."""
    if not f.get("groups"):
        return None
    after = [e for e in epochs if e["time"] > f["t"]]
    if after and "members" in after[0]:
        want = {g * procs + i for g in f["groups"] for i in range(procs)}
        before = [e for e in epochs if e["time"] <= f["t"]]
        if before and not want <= set(before[-1]["members"]):  # out already (still starting): back in the next one
            out = 0
        else:
            out = next((i for i, e in enumerate(after) if not want <= set(e["members"])), None)
        if want <= set(after[0].get("healed") or []):  # a spare took the place before an epoch went on without it
            out = 0
        elif out is None and f.get("kind") != "all":  # (every group down: the job's restart has them all)
            return None
        back = next((e for e in after[out or 0:] if want <= set(e["members"])), None)
        first = [t for t, _ in train if back and t > back["time"]]
        return min(first) if first else None
    born = [s for s in starts if f.get("group") is not None and s.get("group") == f["group"] and s["t0"] > f["t"]]
    first = [r["time"] for r in recs if born and r.get("kind") == "group_train" and r["group"] == f["group"]
             and r["time"] > born[0]["t0"]]
    return min(first) if first else None


def measure(run_dir: Path, wall: float, faults: list, ref: dict | None, procs: int = 1) -> dict:
    recs = read_records(run_dir / "metrics.jsonl")
    train = sorted((r["time"], r["step"]) for r in recs if r.get("kind") == "train")
    step_s = statistics.median(r["step_ms"] for r in recs if r.get("kind") == "train" and r["step"] > 1) / 1000
    steps = max(s for _, s in train)
    gaps, lost, rejoins, regroups, parts, by_kind, costs = [], [], [], [], [], {}, []
    epochs = [r for r in recs if r.get("kind") == "epoch"]
    starts = [r for r in recs if r.get("kind") == "start"]
    for n, f in enumerate(faults):
        before = [s for t, s in train if t <= f["t"]]
        after = [(t, s) for t, s in train if t > f["t"]]
        if not before or not after:
            continue
        gaps.append(after[0][0] - f["t"])
        until = faults[n + 1]["t"] if n + 1 < len(faults) else float("inf")  # (a spare's place taken: its "start")
        formed = [e["time"] for e in epochs if f["t"] < e["time"] < until and e["why"] != "a group joins"]
        if formed:
            regroups.append(formed[0] - f["t"])
        resumed_at = after[0][1] - 1  # the step the survivors (or the restart) went on from
        lost.append(max(before) - resumed_at + 1)
        back_at = rejoined(f, epochs, train, recs, starts, procs)
        horizon = min(until, f["t"] + max(gaps[-1], (back_at or f["t"]) - f["t"]) + 2.0)
        cost = fault_cost(train, f["t"], horizon)
        if cost is not None:
            costs.append(cost)
        if back_at is not None:
            rejoins.append(back_at - f["t"])
            by_kind.setdefault(f.get("kind", "kill"), []).append((gaps[-1], lost[-1], back_at - f["t"]))
            born = [s for s in starts if f.get("group") is not None and s.get("group") == f["group"] and s["t0"] > f["t"]]
            if born and f.get("kind") in ("kill", "agent", None):  # where a restarted group's time went
                spent = {k: v for k, v in born[0].get("s", {}).items() if v >= 0.005 and k in REJOIN_STATES}
                parts.append({"restart": born[0]["t0"] - f["t"], **spent,
                              "to_first_step": back_at - born[0]["t0"] - sum(spent.values())})
        else:
            by_kind.setdefault(f.get("kind", "kill"), []).append((gaps[-1], lost[-1], None))
    out = {"steps": steps, "wall_s": round(wall, 1), "step_s": round(step_s, 4), "faults": len(faults)}
    # torchft trains a smaller global batch while a group is away: its steps counted by the share of
    # the global batch they trained (mingpt's steps are always whole)
    batches = sum(n / GROUPS for n in {r["step"]: r.get("participants", GROUPS)  # a step trained again counts once
                                       for r in recs if r.get("kind") == "train"}.values())
    if ref is not None:
        out["goodput"] = round(steps * ref["step_s"] / wall, 4)
        out["batch_goodput"] = round(batches * ref["step_s"] / wall, 4)
        if ref.get("wall_s") and faults:  # what the faults cost, the start-up and the end set aside
            out["vs_fault_free"] = round(ref["wall_s"] / wall, 4)
            out["cost_per_fault_s"] = round((wall - ref["wall_s"]) / len(faults), 2)
        w = final(run_dir)
        out["final_max_abs_diff"] = max((w[k].float() - ref["weights"][k].float()).abs().max().item() for k in w)
    else:
        out["goodput"] = round(steps * step_s / wall, 4)
    stat = lambda xs: {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else None  # noqa: E731
    out.update(survivor_gap_s=stat(gaps), new_epoch_s=stat(regroups), steps_lost_per_fault=stat(lost),
               rejoin_s=stat(rejoins), fault_cost_s=stat(costs))
    if costs:  # the share of the run the faults took, each measured against the pace just before it
        out["lost_to_faults"] = round(sum(costs) / wall, 4)
    if parts:  # the medians of a restarted group's rejoin, part by part (the start record's ledger)
        out["rejoin_parts_s"] = {k: round(statistics.median(p.get(k, 0.0) for p in parts), 3)
                                 for k in ["restart", *REJOIN_STATES, "to_first_step"] if any(k in p for p in parts)}
    if len(by_kind) > 1:
        out["by_kind"] = {k: {"faults": len(v), "survivor_gap_s": stat([g for g, _, _ in v]),
                              "steps_lost": stat([n for _, n, _ in v]),
                              "rejoin_s": stat([r for _, _, r in v if r is not None])} for k, v in sorted(by_kind.items())}
    (run_dir / "faults.json").write_text(json.dumps(faults))
    return out


def fault_cost(train: list[tuple[float, int]], t: float, horizon: float, pace_of: int = PACE_OF) -> float | None:
    """What a fault at `t` cost the job, from the steps committed around it: the time from the last step
    before it to the last step by `horizon` (the group back, and 2 s more), less what those steps took at
    the pace of the `pace_of` steps before the fault (their median interval). Steps trained again (a
    restart from a snapshot) count against it. Unlike the wall time against the fault-free run's, the
    drift of a machine's speed over a run (several % here) stays out of it."""
    before = [(tt, s) for tt, s in train if tt <= t][-(pace_of + 1):]
    by = [(tt, s) for tt, s in train if t < tt <= horizon]
    if len(before) < pace_of + 1 or not by:
        return None
    pace = statistics.median(b[0] - a[0] for a, b in zip(before, before[1:]))
    (t0, s0), (t1, s1) = before[-1], by[-1]
    return round((t1 - t0) - (s1 - s0) * pace, 3)


def replicas_job(args, run_dir: Path, faults, nodes=None, groups: int = GROUPS) -> tuple[float, list, str]:
    """3 replica groups (or `groups`) on loopback (or one per network namespace node)."""
    addrs = [n.addr for n in nodes] if nodes else ["127.0.0.1"] * groups
    procs = args.procs_per_group
    ports = free_port_runs(groups, procs) if not nodes else [29500 + i for i in range(groups)]
    peers = [f"{a}:{p}" for a, p in zip(addrs, ports)]
    cmds = []
    for g in range(groups):
        env = {**os.environ, "MINGPT_JOB_SECRET": SECRET, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": "1"}
        if nodes:
            env["GLOO_SOCKET_IFNAME"] = nodes[g].veth
        cmd = [*torchrun(procs, nodes[g].prefix() if nodes else []),
               *job_args(args.model, args.steps, run_dir, args.corpus, args.snapshot_every, args.set),
               f"replicas.peers=[{','.join(peers)}]", f"replicas.group={g}", f"replicas.shares_per_group={args.shares_per_group}"]
        cmds.append((cmd, env))
    # --spares: each group's command started twice, the second standing by (in the group's CPU share, or
    # on the cores beside the groups' with --spare-cores)
    return run(cmds * (1 + args.spares), run_dir, faults, args.limit_s, isolate=args.isolate, shares_of=groups,
               beside=args.spare_cores)


def torchft_job(args, run_dir: Path, faults) -> tuple[float, list, str]:
    """The same 3 groups through torchft's Manager (benchmarks/torchft_worker.py), its lighthouse on
    loopback; the groups' records merged into metrics.jsonl (a step: its first commit)."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    # a quorum of 2 (a majority, as replicas.min_groups), a group lost after 1 s of silence (as
    # replicas.lost_after_s; torchft's default is 5 s), stragglers waited for 1 s
    beside = Path(sys.executable).parent / "torchft_lighthouse"  # (a virtual environment not on PATH)
    lighthouse = subprocess.Popen([str(beside) if beside.exists() else "torchft_lighthouse",
                                   "--min_replicas", "2", "--heartbeat_timeout_ms", "1000",
                                   "--join_timeout_ms", "1000", "--bind", f"127.0.0.1:{port}"],
                                  stdout=open(run_dir / "lighthouse.log", "w"), stderr=subprocess.STDOUT,
                                  preexec_fn=die_with_bench)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchft's Manager joins the store torchrun shares
    cmds = [([*torchrun(1), "-m", "benchmarks.torchft_worker", "--group", str(g), "--groups", str(GROUPS),
              "--lighthouse", f"http://127.0.0.1:{port}", "--run-dir", str(run_dir), "--corpus", args.corpus,
              "--model", args.model, "--steps", str(args.steps)], env) for g in range(GROUPS)]
    try:
        out = run(cmds, run_dir, faults, args.limit_s, ended=lambda: any(run_dir.glob("final-*.pt")),
                  isolate=args.isolate, beside=args.spare_cores)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    recs = [r for m in sorted(run_dir.glob("metrics-*.jsonl")) for r in read_records(m)]
    firsts = {}
    for r in sorted((r for r in recs if r["kind"] == "train"), key=lambda r: r["time"]):
        firsts.setdefault(r["step"], r)
    merged = [r for r in recs if r["kind"] == "start"] + list(firsts.values()) + [
        {**r, "kind": "group_train"} for r in recs if r["kind"] == "train"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in merged))
    return out


def restart_job(args, run_dir: Path, faults) -> tuple[float, list, str]:
    """Today's job: one torchrun of 3 workers (DDP), restarted whole, from the newest snapshot; in one CPU
    share of all the cores the groups have between them."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun(GROUPS), *job_args(args.model, args.steps, run_dir, args.corpus, 5, args.set)]
    return run([(cmd, env)], run_dir, faults, args.limit_s, isolate=args.isolate, shares_of=1, beside=args.spare_cores)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks survivors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill-every", nargs="+", type=float, default=[60, 30, 15], help="seconds between SIGKILLs")
    ap.add_argument("--kinds", nargs="*", default=["freeze", "agent", "two", "all"], choices=KINDS,
                    help="replica groups: a row for each of these fault kinds too (--kind-every apart)")
    ap.add_argument("--kind-every", type=float, default=30, help="seconds between the faults of the --kinds rows")
    ap.add_argument("--hold-s", type=float, default=3.0, help="how long a freeze (SIGSTOP) or a soak's cut lasts")
    ap.add_argument("--soak", type=int, default=0, metavar="N", help="only the soak: N faults of every kind mixed "
                    "at random (--seed), --soak-every s apart, in one replica job, against its fault-free run")
    ap.add_argument("--soak-every", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--corpus", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--snapshot-every", type=int, default=50, help="replica groups: steps between snapshots")
    ap.add_argument("--cut-s", type=float, default=10.0, help="how long the partition lasts (0: no partition)")
    ap.add_argument("--no-restart-baseline", action="store_true", help="skip today's single-torchrun job")
    ap.add_argument("--no-replicas", action="store_true", help="skip mingpt's replica groups (the other modes only)")
    ap.add_argument("--no-torchft", action="store_true", help="skip the same groups through torchft's Manager")
    ap.add_argument("--no-isolation", dest="isolate", action="store_false",
                    help="no CPU share per group: every job's processes share the machine's cores")
    ap.add_argument("--restart-kill-every", nargs="+", type=float, help="its fault intervals (default: --kill-every)")
    ap.add_argument("--reuse-reference", help="the run directory of a kept fault-free replica run of the same "
                                              "settings (its step time and weights), instead of running it again")
    ap.add_argument("--shares-per-group", type=int, default=0, help="replica groups: replicas.shares_per_group "
                                                                     "(default 0: min(groups - 1, 4))")
    ap.add_argument("--procs-per-group", type=int, default=1, help="replica groups: processes per group's "
                                                                   "torchrun (each a member; the SIGKILL takes one)")
    ap.add_argument("--max-kills", type=int, default=0, help="faults per job at most (default: no limit)")
    ap.add_argument("--spares", action="store_true", help="replica groups: each group's command started twice, the "
                    "second standing by, built, to take a killed member's place (mingpt/replicas/standby.py)")
    ap.add_argument("--spare-cores", type=float, default=0.0, metavar="C", help="C cores beside the groups' shares "
                    "(theirs cut from the rest, in every mode alike): with --spares, a group's spare, standing by or "
                    "starting up, runs there, as on a GPU node's idle cores, and its member in the group's share")
    ap.add_argument("--limit-s", type=float, default=3600)
    ap.add_argument("--keep", help="keep every job's run directory here")
    ap.add_argument("--seconds", type=float, default=0, help="size the jobs to the machine: a short fault-free "
                    "replica run measures the step, and --steps becomes this many seconds of steps")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more overrides for mingpt's jobs, e.g. trainer.deterministic=true")
    args = ap.parse_args(argv)
    if not 0 <= args.spare_cores < (os.cpu_count() or 1):
        ap.error(f"--spare-cores {args.spare_cores:g}: from 0 to below this machine's {os.cpu_count()} cores")
    if args.spares and args.procs_per_group > 1:
        ap.error("--spares: groups of one process (a spare per member of larger groups is not measured here)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still removes its cgroups, mends links
    with tempfile.TemporaryDirectory(prefix="mingpt-survivors-") as scratch:
        Bench(args, Path(args.keep or scratch)).run()


class Bench:
    """The settings of one `python -m benchmarks survivors`, a JSON line each."""

    def __init__(self, args, tmp: Path):
        self.args, self.tmp = args, tmp
        self.base = {"model": args.model, "groups": GROUPS, "steps": args.steps, "cpus": os.cpu_count(),
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     **({"procs_per_group": args.procs_per_group} if args.procs_per_group > 1 else {})}
        self.job = {"replicas": lambda d, f: replicas_job(args, d, f), "torchft": lambda d, f: torchft_job(args, d, f),
                    "single torchrun": lambda d, f: restart_job(args, d, f)}

    def print(self, **fields) -> None:
        print(json.dumps({**self.base, **fields}), flush=True)

    def procs(self, mode: str) -> int:
        return self.args.procs_per_group if mode == "replicas" else 1

    def reference(self, mode: str, name: str) -> tuple:
        """The fault-free run: its figures, and (step time, final weights) for the faulted runs."""
        wall, _, isolation = self.job[mode](self.tmp / f"{name}-none", None)
        got = measure(self.tmp / f"{name}-none", wall, [], None, self.procs(mode))
        self.print(mode=mode, fault="none", isolation=isolation, **got)
        return got, {"step_s": got["step_s"], "wall_s": got["wall_s"], "weights": final(self.tmp / f"{name}-none")}

    def faulted(self, mode: str, name: str, ref: tuple, fault: str, faults: Faults, nodes=None) -> None:
        d = self.tmp / name
        faults.run_dir = d
        if nodes:
            wall, done, isolation = replicas_job(self.args, d, faults, nodes=nodes)
        else:
            wall, done, isolation = self.job[mode](d, faults)
        self.print(mode=mode, fault=fault, isolation=isolation, **measure(d, wall, done, ref[1], self.procs(mode)))

    def rows(self, mode: str, name: str, intervals, ref: tuple | None = None) -> tuple:
        """The fault-free run (unless `ref` is given), then one run SIGKILLed every T s for each T."""
        ref = ref or self.reference(mode, name)
        for every in intervals:
            self.faulted(mode, f"{name}-kill{every:g}", ref, f"SIGKILL every {every:g} s",
                         killer(every, groups=mode != "single torchrun", run_dir=None, max_kills=self.args.max_kills))
        return ref

    def run(self) -> None:
        args = self.args
        if args.seconds:
            probe = argparse.Namespace(**{**vars(args), "steps": 60})
            wall, _, _ = replicas_job(probe, self.tmp / "probe", None)
            step_s = measure(self.tmp / "probe", wall, [], None, args.procs_per_group)["step_s"]
            args.steps = self.base["steps"] = max(60, round(args.seconds / step_s))
            self.print(mode="replicas", probe_step_s=step_s, probe_wall_s=round(wall, 1))
        if args.soak:
            return self.soak()
        ref = None
        if not args.no_replicas:
            if args.reuse_reference:
                kept = Path(args.reuse_reference)
                recs = read_records(kept / "metrics.jsonl")
                wall = max(r["time"] for r in recs if "time" in r) - min(r["t0"] for r in recs if r.get("kind") == "start")
                got = measure(kept, wall, [], None, args.procs_per_group)
                ref = got, {"step_s": got["step_s"], "weights": final(kept)}
                self.print(mode="replicas", fault="none", reused=args.reuse_reference, **got)
            ref = self.rows("replicas", "replicas", args.kill_every, ref)
            for kind in args.kinds:
                if kind == "partition":
                    continue  # its own row below, in network namespaces
                self.faulted("replicas", f"replicas-{kind}", ref, f"{KIND_NAMES[kind]} every {args.kind_every:g} s",
                             Faults(args.kind_every, (kind,), max_faults=args.max_kills, hold_s=args.hold_s))
            if args.cut_s:
                self.partition(ref)
        if not args.no_torchft:
            try:
                import torchft  # noqa: F401 - benchmark-only: pip install torchft==0.2.0 (it needs torch>=2.7)
            except ImportError as e:
                self.print(mode="torchft", fault="none", skipped=str(e))
            else:
                self.rows("torchft", "torchft", args.kill_every)
        if not args.no_restart_baseline:
            single = self.rows("single torchrun", "restart", [])
            if ref is not None:
                # today's DDP with the same global batch against the replica groups without faults: the sums
                # differ in order only (gloo's ring, bucket by bucket, against share order)
                diff = max((single[1]["weights"][k].float() - ref[1]["weights"][k].float()).abs().max().item()
                           for k in ref[1]["weights"])
                self.print(mode="replicas against single torchrun (DDP)", fault="none", final_max_abs_diff=diff)
            self.rows("single torchrun", "restart", args.restart_kill_every or args.kill_every, single)

    def partition(self, ref: tuple) -> None:
        """Each group in its own network namespace on one bridge; group 2's link cut for --cut-s."""
        try:
            with bridged_nodes(GROUPS) as bridge:
                at = max(10.0, 0.4 * ref[0]["wall_s"])  # in steady training, after the start-up
                faults = Faults(at, ("partition",), max_faults=1, bridge=bridge, hold_s=self.args.cut_s)
                faults.n = 2  # group 2's link
                self.faulted("replicas", "replicas-partition", ref, f"group 2's link cut for {self.args.cut_s:g} s",
                             faults, nodes=bridge.nodes)
        except NoNamespaces as e:
            self.print(mode="replicas", fault="partition", skipped=str(e))

    def soak(self) -> None:
        """--soak N faults of every kind, drawn at random (--seed), in one job (in network namespaces,
        where the machine allows, so that links can be cut), against the same job without faults."""
        args = self.args
        ref = self.reference("replicas", "replicas")
        kinds = KINDS
        try:
            with bridged_nodes(GROUPS) as bridge:
                self.faulted("replicas", "replicas-soak", ref, f"soak: {args.soak} faults mixed (seed {args.seed}), "
                             f"every {args.soak_every:g} s", Faults(args.soak_every, kinds, max_faults=args.soak,
                                                                     seed=args.seed, bridge=bridge, hold_s=args.hold_s),
                             nodes=bridge.nodes)
        except NoNamespaces as e:
            kinds = tuple(k for k in KINDS if k != "partition")
            self.print(mode="replicas", fault="soak: no partitions", skipped=str(e))
            self.faulted("replicas", "replicas-soak", ref, f"soak: {args.soak} faults mixed (seed {args.seed}, no "
                         f"partition), every {args.soak_every:g} s", Faults(args.soak_every, kinds, max_faults=args.soak,
                                                                             seed=args.seed, hold_s=args.hold_s))


if __name__ == "__main__":
    main()
