"""Goodput under faults: a 2-worker gpt-mini job under torchrun on this machine, a random worker
SIGKILLed every T seconds, snapshots every N steps. For each (T, N): the job's wall time, its goodput
and where the rest went (from the run's metrics alone, as `python -m mingpt.report` computes it), and
whether the final weights equal those of the same job run without faults.

    python -m benchmarks goodput [--kill-every 30 60] [--snapshot-every 5 10 25] [--steps 500] [--keep DIR]

With --keep, every job's run directory (metrics, snapshots, console.log) stays in DIR: look at one
with `python -m mingpt.report DIR/t60-n10`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import children, die_with_bench
from mingpt.report.goodput import account, read_records
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

REPO = Path(__file__).resolve().parents[1]


def job(run_dir: Path, corpus: str, steps: int, every: int, kill_every: float, rng: random.Random,
        model: str = "gpt-mini", limit_s: float = float("inf"), max_kills: int = 0) -> dict:
    """One job to `steps`, a random trainer SIGKILLed every `kill_every` s (0: never), at most
    `max_kills` times (0: no limit); stopped with an error after `limit_s` (kills closer together than
    a restart takes would go on for ever)."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1000",
           "-m", "mingpt.main", f"model={model}", f"trainer.max_steps={steps}", "trainer.log_every=10",
           "trainer.eval_every=0", f"snapshot.every_steps={every}", f"trainer.run_dir={run_dir}", f"data.path={corpus}",
           "trainer.progress=false"]
    t0 = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "console.log"
    agent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=die_with_bench)
    kills, next_kill = 0, t0 + kill_every
    try:
        while agent.poll() is None:
            if time.time() - t0 > limit_s:
                raise RuntimeError(f"the job did not finish in {limit_s:.0f} s: a SIGKILL every {kill_every:g} s may "
                                   f"come before a restart reaches its first step (see {log})")
            if kill_every and time.time() >= next_kill and not (max_kills and kills >= max_kills):
                victims = children(agent.pid)
                if victims:
                    try:
                        os.kill(rng.choice(victims), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass
                next_kill += kill_every
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    wall_outside = time.time() - t0
    if agent.returncode != 0:
        raise RuntimeError(f"the job failed ({agent.returncode}):\n{log.read_text()[-3000:]}")
    acc = account(read_records(run_dir / "metrics.jsonl"))
    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    return {"kills": kills, "wall_outside": wall_outside, "account": acc, "weights": state["model"],
            "step": manifest["step"]}


def row(label_t: str, every: int, r: dict, same: bool | None) -> str:
    acc = r["account"]
    s, w = acc.seconds, acc.wall
    pct = lambda k: f"{100 * s[k] / w:.1f}"  # noqa: E731
    other = s["data_wait"] + s["eval"] + s["log"]
    restarts = len(acc.attempts) - 1
    return (f"| {label_t} | {every} | {r['kills']} | {restarts} | {w:.0f} ({r['wall_outside']:.0f}) | "
            f"**{100 * acc.goodput:.1f}** | {pct('lost')} | {pct('down')} | {pct('startup')} | {pct('snapshot')} | "
            f"{100 * other / w:.1f} | {'bitwise equal' if same else ('-' if same is None else 'DIFFERENT')} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks goodput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill-every", nargs="+", type=float, default=[30, 60], help="seconds between SIGKILLs")
    ap.add_argument("--snapshot-every", nargs="+", type=int, default=[5, 10, 25], help="steps between snapshots")
    ap.add_argument("--steps", type=int, default=500, help="the job's length in steps (gpt-mini: ~0.4 s each here)")
    ap.add_argument("--corpus", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="keep every job's run directory here (default: a temporary one)")
    ap.add_argument("--max-kills", type=int, default=0, help="SIGKILLs per job at most (default: no limit)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="mingpt-goodput-") as scratch:
        tmp = args.keep or scratch
        print(f"{args.model}, 2 workers (torchrun --standalone, gloo), {args.steps} steps, log every 10 steps, no "
              f"evaluation; {os.cpu_count()} CPUs", flush=True)
        header = ("| fault every | snapshot every (steps) | SIGKILLs | restarts | wall s (outside) | goodput % | "
                  "lost % | restart % | start-up % | snapshot % | other % | final weights |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|---|")
        print(header, flush=True)
        ref = job(Path(tmp) / "ref", args.corpus, args.steps, max(args.snapshot_every), 0, rng, args.model)
        print(row("never", max(args.snapshot_every), ref, None), flush=True)
        best = {}
        for t in args.kill_every:
            for n in args.snapshot_every:
                r = job(Path(tmp) / f"t{t:g}-n{n}", args.corpus, args.steps, n, t, rng, args.model,
                        limit_s=20 * ref["wall_outside"] + 120, max_kills=args.max_kills)
                same = r["step"] == ref["step"] and all(torch.equal(v, ref["weights"][k])
                                                        for k, v in r["weights"].items())
                print(row(f"{t:g} s", n, r, same), flush=True)
                if r["account"].goodput > best.get(t, (0, 0))[1]:
                    best[t] = (n, r["account"].goodput)
        for t, (n, g) in best.items():
            print(f"fault every {t:g} s: the best snapshot interval is {n} steps ({100 * g:.1f}% goodput)")


if __name__ == "__main__":
    main()
