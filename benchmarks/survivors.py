"""Survivors keep training: a job of 3 replica groups (mingpt.replicas, each group its own torchrun of
one process, or of --procs-per-group) on this machine, one group's worker SIGKILLed every T seconds
(the groups in turn, the coordinator included; torchrun restarts it and it heals from a live peer),
and a network partition (each group in its own network namespace on one bridge; one group's link
cut for --cut-s seconds).
Beside it, the same 3 groups through torchft 0.2.0's Manager (its lighthouse, `Manager.allreduce`,
`should_commit`, healing by its own transport; benchmarks/torchft_worker.py; skipped where torchft
is not installed), and the same job under today's single torchrun (3 workers, DDP, restarted from a
snapshot every 5 steps). One JSON line per setting:

    python -m benchmarks survivors [--kill-every 60 30 15] [--steps 600] [--model gpt-mini] [--keep DIR]
        [--no-replicas] [--no-torchft] [--no-restart-baseline] [--cut-s 0] [--shares-per-group K]
        [--procs-per-group N] [--seconds S] [--set KEY=VALUE ...]

goodput: steps x the fault-free run's median step time / wall time (launch to exit); batch_goodput:
the same with each step counted by the share of the global batch it trained (torchft's steps while a
group is away train the survivors' shares only; mingpt's are always whole);
survivor_gap_s: a fault to the next step committed (median, max; that step is the one in flight,
trained again, with the lost group's shares split among the survivors); new_epoch_s: a fault to the survivors'
new epoch (detection and forming); steps_lost_per_fault: steps whose
compute was thrown away (the step in flight, and for a restart the steps since the snapshot);
rejoin_s: the restarted process's start to the first step it committed in; final_max_abs_diff:
final weights against the fault-free run of the same mode (and, on its own line, the fault-free
replica run against today's DDP run with the same global batch).
"""

from __future__ import annotations

import argparse
import json
import os
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
from benchmarks.netns import NoNamespaces, bridged_nodes
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest
from mingpt.training.metrics import read_records

REPO = Path(__file__).resolve().parents[1]
SECRET = secrets.token_hex(32)  # the same for every group of one bench run
GROUPS = 3


def job_args(model: str, steps: int, run_dir: Path, corpus: str, snapshot_every: int, extra=()) -> list[str]:
    return ["-m", "mingpt.main", f"model={model}", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.eval_every=0", f"snapshot.every_steps={snapshot_every}", f"trainer.run_dir={run_dir}",
            f"data.path={corpus}", "trainer.progress=false", "trainer.threads=1", *extra]


def torchrun(nproc: int, prefix: list[str] = ()) -> list[str]:
    return [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max-restarts=1000", "--monitor-interval=0.2"]


def run(cmds: list[tuple[list[str], dict]], run_dir: Path, faults, limit_s: float, ended=None) -> tuple[float, list]:
    """Start every agent, run `faults(agents, t0)` until they all exit (or, with `ended`, until it
    is true: the agents still running 5 s later are stopped); (wall s, what faults did)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(run_dir / f"console{i}.log", "w"),
                               stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_bench)
              for i, (cmd, env) in enumerate(cmds)]
    done, end = [], None
    try:
        while any(a.poll() is None for a in agents):
            if time.time() - t0 > limit_s:
                raise RuntimeError(f"the job did not finish in {limit_s:.0f} s (see {run_dir}/console*.log)")
            if end is None and ended is not None and ended():
                end = time.time()
            if end is not None and time.time() - end > 5:
                break
            if faults is not None and end is None:
                done.extend(faults(agents, t0))
            time.sleep(0.02)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    wall = (end or time.time()) - t0
    codes = [a.returncode for a in agents if end is None or a.returncode >= 0]
    if any(codes):
        logs = "\n".join((run_dir / f"console{i}.log").read_text()[-2000:] for i in range(len(agents)))
        raise RuntimeError(f"the job failed ({codes}):\n{logs}")
    return wall, done


def killer(every: float, groups: bool, run_dir: Path, max_kills: int = 0):
    """SIGKILL a worker every `every` s (at most `max_kills` times; 0: no limit): the groups' workers in
    turn (replicas), or a worker of the one agent."""
    state = {"next": every, "n": 0}

    def faults(agents, t0):
        if not every or time.time() - t0 < state["next"] or (max_kills and state["n"] >= max_kills):
            return []
        if not state.get("training"):  # a fault during the start-up tells nothing of survivors: wait for a step
            state["training"] = any('"kind": "train"' in m.read_text() for m in run_dir.glob("metrics*.jsonl"))
            if not state["training"]:
                return []
        state["next"] = time.time() - t0 + every  # faults `every` s apart, also after a long start-up
        agent = agents[state["n"] % len(agents)] if groups else agents[0]
        victims = children(agent.pid)
        if not victims:
            return []
        victim = victims[state["n"] % len(victims)] if not groups else victims[0]
        state["n"] += 1
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            return []
        return [{"t": time.time(), "group": (state["n"] - 1) % len(agents) if groups else None}]
    return faults


def final(run_dir: Path) -> dict:
    ends = sorted(run_dir.glob("final-*.pt"))  # torchft's groups
    if ends:
        return torch.load(ends[0], weights_only=True)
    state, _ = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    return state["model"]


def measure(run_dir: Path, wall: float, faults: list, ref: dict | None, procs: int = 1) -> dict:
    recs = read_records(run_dir / "metrics.jsonl")
    train = sorted((r["time"], r["step"]) for r in recs if r.get("kind") == "train")
    step_s = statistics.median(r["step_ms"] for r in recs if r.get("kind") == "train" and r["step"] > 1) / 1000
    steps = max(s for _, s in train)
    gaps, lost, rejoins, regroups = [], [], [], []
    epochs = [r for r in recs if r.get("kind") == "epoch"]
    starts = [r for r in recs if r.get("kind") == "start"]
    for f in faults:
        before = [s for t, s in train if t <= f["t"]]
        after = [(t, s) for t, s in train if t > f["t"]]
        if not before or not after:
            continue
        gaps.append(after[0][0] - f["t"])
        formed = [e["time"] for e in epochs if e["time"] > f["t"] and e["why"] not in ("start", "a group joins")]
        if formed:
            regroups.append(formed[0] - f["t"])
        resumed_at = after[0][1] - 1  # the step the survivors (or the restart) went on from
        lost.append(max(before) - resumed_at + 1)
        born = [s for s in starts if f.get("group") is not None and s.get("group") == f["group"] and s["t0"] > f["t"]]
        back = [e for e in epochs if born and e["time"] > f["t"]  # (healed members: group x procs + process)
                and f["group"] in {m // procs for m in e.get("healed", [])}]
        first = [t for t, _ in train if back and t > back[0]["time"]] or [  # torchft: the group's own first commit
            r["time"] for r in recs if born and r.get("kind") == "group_train" and r["group"] == f["group"]
            and r["time"] > born[0]["t0"]]
        if first:
            rejoins.append(min(first) - born[0]["t0"])
    out = {"steps": steps, "wall_s": round(wall, 1), "step_s": round(step_s, 4), "faults": len(faults)}
    # torchft trains a smaller global batch while a group is away: its steps counted by the share of
    # the global batch they trained (mingpt's steps are always whole)
    batches = sum(n / GROUPS for n in {r["step"]: r.get("participants", GROUPS)  # a step trained again counts once
                                       for r in recs if r.get("kind") == "train"}.values())
    if ref is not None:
        out["goodput"] = round(steps * ref["step_s"] / wall, 4)
        out["batch_goodput"] = round(batches * ref["step_s"] / wall, 4)
        w = final(run_dir)
        out["final_max_abs_diff"] = max((w[k].float() - ref["weights"][k].float()).abs().max().item() for k in w)
    else:
        out["goodput"] = round(steps * step_s / wall, 4)
    stat = lambda xs: {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else None  # noqa: E731
    out.update(survivor_gap_s=stat(gaps), new_epoch_s=stat(regroups), steps_lost_per_fault=stat(lost),
               rejoin_s=stat(rejoins))
    (run_dir / "faults.json").write_text(json.dumps(faults))
    return out


def replicas_job(args, run_dir: Path, faults, nodes=None) -> tuple[float, list]:
    """3 replica groups on loopback (or one per network namespace node)."""
    addrs = [n.addr for n in nodes] if nodes else ["127.0.0.1"] * GROUPS
    procs = args.procs_per_group
    ports = free_port_runs(GROUPS, procs) if not nodes else [29500 + i for i in range(GROUPS)]
    peers = [f"{a}:{p}" for a, p in zip(addrs, ports)]
    cmds = []
    for g in range(GROUPS):
        env = {**os.environ, "MINGPT_JOB_SECRET": SECRET, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "OMP_NUM_THREADS": "1"}
        if nodes:
            env["GLOO_SOCKET_IFNAME"] = nodes[g].veth
        cmd = [*torchrun(procs, nodes[g].prefix() if nodes else []),
               *job_args(args.model, args.steps, run_dir, args.corpus, args.snapshot_every, args.set),
               f"replicas.peers=[{','.join(peers)}]", f"replicas.group={g}", f"replicas.shares_per_group={args.shares_per_group}"]
        cmds.append((cmd, env))
    return run(cmds, run_dir, faults, args.limit_s)


def torchft_job(args, run_dir: Path, faults) -> tuple[float, list]:
    """The same 3 groups through torchft's Manager (benchmarks/torchft_worker.py), its lighthouse on
    loopback; the groups' records merged into metrics.jsonl (a step: its first commit)."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    # a quorum of 2 (a majority, as replicas.min_groups), a group lost after 1 s of silence (as
    # replicas.lost_after_s; torchft's default is 5 s), stragglers waited for 1 s
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "2", "--heartbeat_timeout_ms", "1000",
                                   "--join_timeout_ms", "1000", "--bind", f"127.0.0.1:{port}"],
                                  stdout=open(run_dir / "lighthouse.log", "w"), stderr=subprocess.STDOUT,
                                  preexec_fn=die_with_bench)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchft's Manager joins the store torchrun shares
    cmds = [([*torchrun(1), "-m", "benchmarks.torchft_worker", "--group", str(g), "--groups", str(GROUPS),
              "--lighthouse", f"http://127.0.0.1:{port}", "--run-dir", str(run_dir), "--corpus", args.corpus,
              "--model", args.model, "--steps", str(args.steps)], env) for g in range(GROUPS)]
    try:
        out = run(cmds, run_dir, faults, args.limit_s, ended=lambda: any(run_dir.glob("final-*.pt")))
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


def restart_job(args, run_dir: Path, faults) -> tuple[float, list]:
    """Today's job: one torchrun of 3 workers (DDP), restarted whole, from the newest snapshot."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun(GROUPS), *job_args(args.model, args.steps, run_dir, args.corpus, 5, args.set)]
    return run([(cmd, env)], run_dir, faults, args.limit_s)


def partition(bridge, victim, cut_s: float, at_s: float):
    state = {"done": False}

    def faults(agents, t0):  # noqa: ARG001 - the same signature as killer's
        if state["done"] or time.time() - t0 < at_s:
            return []
        state["done"] = True
        t = time.time()
        bridge.cut(victim)
        time.sleep(cut_s)  # the job trains on meanwhile, in its own processes
        bridge.mend(victim)
        return [{"t": t, "group": None}]
    return faults


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks survivors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill-every", nargs="+", type=float, default=[60, 30, 15], help="seconds between SIGKILLs")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--corpus", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--snapshot-every", type=int, default=50, help="replica groups: steps between snapshots")
    ap.add_argument("--cut-s", type=float, default=10.0, help="how long the partition lasts (0: no partition)")
    ap.add_argument("--no-restart-baseline", action="store_true", help="skip today's single-torchrun job")
    ap.add_argument("--no-replicas", action="store_true", help="skip mingpt's replica groups (the other modes only)")
    ap.add_argument("--no-torchft", action="store_true", help="skip the same groups through torchft's Manager")
    ap.add_argument("--restart-kill-every", nargs="+", type=float, help="its fault intervals (default: --kill-every)")
    ap.add_argument("--reuse-reference", help="the run directory of a kept fault-free replica run of the same "
                                              "settings (its step time and weights), instead of running it again")
    ap.add_argument("--shares-per-group", type=int, default=0, help="replica groups: replicas.shares_per_group "
                                                                     "(default 0: groups - 1)")
    ap.add_argument("--procs-per-group", type=int, default=1, help="replica groups: processes per group's "
                                                                   "torchrun (each a member; the SIGKILL takes one)")
    ap.add_argument("--max-kills", type=int, default=0, help="SIGKILLs per job at most (default: no limit)")
    ap.add_argument("--limit-s", type=float, default=3600)
    ap.add_argument("--keep", help="keep every job's run directory here")
    ap.add_argument("--seconds", type=float, default=0, help="size the jobs to the machine: a short fault-free "
                    "replica run measures the step, and --steps becomes this many seconds of steps")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more overrides for mingpt's jobs, e.g. trainer.deterministic=true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mingpt-survivors-") as scratch:
        tmp = Path(args.keep or scratch)
        base = {"model": args.model, "groups": GROUPS, "steps": args.steps, "cpus": os.cpu_count(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                **({"procs_per_group": args.procs_per_group} if args.procs_per_group > 1 else {})}
        job = {"replicas": lambda d, f: replicas_job(args, d, f), "torchft": lambda d, f: torchft_job(args, d, f),
               "single torchrun": lambda d, f: restart_job(args, d, f)}

        def procs(mode: str) -> int:
            return args.procs_per_group if mode == "replicas" else 1

        def rows(mode: str, name: str, intervals, ref: tuple | None = None) -> tuple:
            """The fault-free run (unless `ref`, its figures and final state, is given), then one run
            SIGKILLed every T s for each T; returns `ref`."""
            if ref is None:
                wall, _ = job[mode](tmp / f"{name}-none", None)
                got = measure(tmp / f"{name}-none", wall, [], None, procs(mode))
                ref = got, {"step_s": got["step_s"], "weights": final(tmp / f"{name}-none")}
                print(json.dumps({**base, "mode": mode, "fault": "none", **got}), flush=True)
            for every in intervals:
                d = tmp / f"{name}-kill{every:g}"
                wall, faults = job[mode](d, killer(every, groups=mode != "single torchrun", run_dir=d,
                                                   max_kills=args.max_kills))
                print(json.dumps({**base, "mode": mode, "fault": f"SIGKILL every {every:g} s",
                                  **measure(d, wall, faults, ref[1], procs(mode))}), flush=True)
            return ref

        if args.seconds:
            probe = argparse.Namespace(**{**vars(args), "steps": 60})
            wall, _ = replicas_job(probe, tmp / "probe", None)
            step_s = measure(tmp / "probe", wall, [], None, args.procs_per_group)["step_s"]
            args.steps = base["steps"] = max(60, round(args.seconds / step_s))
            print(json.dumps({**base, "mode": "replicas", "probe_step_s": step_s, "probe_wall_s": round(wall, 1)}),
                  flush=True)
        ref = None
        if not args.no_replicas:
            if args.reuse_reference:
                kept = Path(args.reuse_reference)
                recs = read_records(kept / "metrics.jsonl")
                wall = max(r["time"] for r in recs if "time" in r) - min(r["t0"] for r in recs if r.get("kind") == "start")
                got = measure(kept, wall, [], None, args.procs_per_group)
                ref = got, {"step_s": got["step_s"], "weights": final(kept)}
                print(json.dumps({**base, "mode": "replicas", "fault": "none", "reused": args.reuse_reference, **got}),
                      flush=True)
            ref = rows("replicas", "replicas", args.kill_every, ref)
            if args.cut_s:
                try:
                    with bridged_nodes(GROUPS) as bridge:
                        d = tmp / "replicas-partition"
                        at = max(10.0, 0.4 * ref[0]["wall_s"])  # in steady training, after the start-up
                        wall, faults = replicas_job(args, d, partition(bridge, bridge.nodes[2], args.cut_s, at),
                                                    nodes=bridge.nodes)
                        print(json.dumps({**base, "mode": "replicas", "fault": f"group 2's link cut for {args.cut_s:g} s",
                                          **measure(d, wall, faults, ref[1], args.procs_per_group)}), flush=True)
                except NoNamespaces as e:
                    print(json.dumps({**base, "mode": "replicas", "fault": "partition", "skipped": str(e)}), flush=True)
        if not args.no_torchft:
            try:
                import torchft  # noqa: F401 - benchmark-only: pip install torchft==0.2.0 (it needs torch>=2.7)
            except ImportError as e:
                print(json.dumps({**base, "mode": "torchft", "fault": "none", "skipped": str(e)}), flush=True)
            else:
                rows("torchft", "torchft", args.kill_every)
        if not args.no_restart_baseline:
            single = rows("single torchrun", "restart", [])
            if ref is not None:
                # today's DDP with the same global batch against the replica groups without faults: the sums
                # differ in order only (gloo's ring, bucket by bucket, against share order)
                diff = max((single[1]["weights"][k].float() - ref[1]["weights"][k].float()).abs().max().item()
                           for k in ref[1]["weights"])
                print(json.dumps({**base, "mode": "replicas against single torchrun (DDP)", "fault": "none",
                                  "final_max_abs_diff": diff}), flush=True)
            rows("single torchrun", "restart", args.restart_kill_every or args.kill_every, single)


if __name__ == "__main__":
    main()
