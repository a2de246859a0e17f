"""Snapshot figures at model scale: for each shape, world size (1 or 2 ranks), strategy (DDP or
FSDP) and store (local disk or S3 on loopback): blocking time per save, total save time, resume time
(snapshot found to first step done) and peak RSS per rank; then SIGKILL recovery under torchrun.

    python -m benchmarks snapshot [--shapes gpt2 gpt2-medium] [--no-s3] [--no-recovery]
        [--uploaders s3fs boto3] [--layouts exchange direct]

Each configuration is two real runs of `benchmarks.snapshot_worker`: one builds the model as
main.py does, takes a step and saves 3 times; a new one (a restart) finds the snapshot, loads it
and takes a step. "fresh RSS" is the saving process's peak after its step, before any save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import die_with_bench
from mingpt.training.metrics import read_records

REPO = Path(__file__).resolve().parents[1]  # benchmarks run from a checkout

CONFIGS = [(1, "ddp"), (2, "ddp"), (2, "fsdp")]  # (world size, strategy); one process runs plainly


def run_worker(world: int, *args: str, env: dict) -> list[dict]:
    """Every rank's figures from one run of the worker."""
    if world == 1:
        cmd = [sys.executable, "-m", "benchmarks.snapshot_worker", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "benchmarks.snapshot_worker", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(shape: str, world: int, strategy: str, url: str, env: dict, uploader: str = "s3fs",
            layout: str = "exchange", repeats: int = 3) -> dict:
    saved = run_worker(world, "save", shape, strategy, url, uploader, layout, str(repeats), env=env)
    resumed = run_worker(world, "resume", shape, strategy, url, uploader, layout, "0", env=env)
    worst = lambda rows, key: max(r[key] for r in rows)  # noqa: E731 - the slowest / largest rank
    return {"held_mb": worst(saved, "held_mb"), "blocking_ms": worst(saved, "blocking_ms"),
            "save_s": saved[0]["save_s"], "failures": saved[0]["failures"], "fresh_rss_mb": worst(saved, "fresh_rss_mb"),
            "restore_s": worst(resumed, "restore_s"), "resume_s": worst(resumed, "to_first_step_s"),
            "resume_rss_mb": worst(resumed, "peak_rss_mb")}


def failed(r: dict) -> str:
    return f" ({r['failures']} failed)" if r["failures"] else ""


def table_row(shape, world, strategy, store, r) -> str:
    return (f"| {shape} | {world} | {strategy} | {store} | {r['held_mb']:,.0f} | {r['blocking_ms']:,.0f} | "
            f"{r['save_s']:.2f} | {r['restore_s']:.2f} | {r['resume_s']:.2f} | {r['fresh_rss_mb']:,.0f} | "
            f"{r['resume_rss_mb']:,.0f} ({r['resume_rss_mb'] / r['fresh_rss_mb']:.2f}x) |"
            + (f" {r['failures']} failed |" if r["failures"] else ""))


def recovery(tmp: Path, corpus: str, model: str = "gpt-mini") -> dict:
    """SIGKILL one worker of a 2-process torchrun job; time until the first resumed step."""
    run_dir = tmp / "recovery"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "mingpt.main", f"model={model}", "trainer.max_steps=100000", "trainer.log_every=1",
           "trainer.eval_every=0", "snapshot.every_steps=20", f"trainer.run_dir={run_dir}", f"data.path={corpus}",
           "trainer.progress=false"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, preexec_fn=die_with_bench)
    metrics = run_dir / "metrics.jsonl"

    def records():
        return read_records(metrics) if metrics.exists() else []  # a line being written is skipped

    try:
        while not any(r.get("step", 0) >= 30 for r in records()):
            time.sleep(0.01)
        killed_at = max(r["step"] for r in records() if r["kind"] == "train")
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        t_kill = time.time()
        os.kill(int(children[-1]), signal.SIGKILL)
        while True:
            recs = records()
            resume = [i for i, r in enumerate(recs) if r["kind"] == "resume"]
            if resume and any(r["kind"] == "train" for r in recs[resume[0]:]):
                first = next(r for r in recs[resume[0]:] if r["kind"] == "train")
                return {"killed_at_step": killed_at, "resumed_from_step": recs[resume[0]]["step"],
                        "steps_lost": killed_at - recs[resume[0]]["step"],
                        "recovery_s": first["time"] - t_kill}
            time.sleep(0.01)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["gpt2", "gpt2-medium"], help="none: only the other figures")
    ap.add_argument("--configs", nargs="+", default=[f"{w}:{s}" for w, s in CONFIGS],
                    help="world:strategy pairs (default: 1:ddp 2:ddp 2:fsdp)")
    ap.add_argument("--no-s3", action="store_true", help="skip the loopback S3 server (SeaweedFS)")
    ap.add_argument("--uploaders", nargs="+", default=["s3fs", "boto3"],
                    help="compare these S3 uploaders (gpt2, 2 DDP ranks)")
    ap.add_argument("--layouts", nargs="+", default=["exchange", "direct"],
                    help="compare these DDP load layouts (gpt2, 2 ranks, local and S3)")
    ap.add_argument("--compare-shape", default="gpt2", help="the shape of the uploader and layout comparisons")
    ap.add_argument("--no-recovery", action="store_true", help="skip the SIGKILL recovery measurement")
    ap.add_argument("--recovery-model", default="gpt-mini", help="the model of the recovery run")
    ap.add_argument("--corpus", default="data/input.txt", help="corpus for the recovery run")
    args = ap.parse_args(argv)
    print("| shape | ranks | strategy | store | state MB per rank | blocking ms | save s | load s | resume s | "
          "fresh RSS MB | resume RSS MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        env, server = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, None
        if not args.no_s3:  # a real S3 server, its objects on this machine's disk
            from benchmarks.seaweed import SeaweedFS

            (Path(tmp) / "weed").mkdir()
            server = SeaweedFS(Path(tmp) / "weed")
            server.start()
            os.environ.update(server.env)
            env.update(server.env)
            import s3fs

            s3fs.S3FileSystem().mkdir("bench")
        def url(store: str) -> str:
            nonlocal n
            n += 1
            return f"{tmp}/s{n}" if store == "local" else f"s3://bench/s{n}"

        stores = ["local"] + ([] if server is None else ["s3"])
        for shape in args.shapes:
            for config in args.configs:
                world, strategy = config.split(":")
                for store in stores:
                    u = url(store)
                    print(table_row(shape, world, strategy, store, measure(shape, int(world), strategy, u, env)),
                          flush=True)
                    if store == "local":
                        shutil.rmtree(u, ignore_errors=True)
        if server is not None and len(args.uploaders) > 1:
            from mingpt.snapshot.s3 import PART_BYTES

            print(f"\nS3 uploaders ({args.compare_shape}, 2 DDP ranks, {PART_BYTES >> 20} MiB parts, 8 in flight): "
                  "total save time")
            for uploader in args.uploaders:
                r = measure(args.compare_shape, 2, "ddp", url("s3"), env, uploader=uploader)
                print(f"- {uploader}: {r['save_s']:.2f} s{failed(r)}",
                      flush=True)
        if len(args.layouts) > 1:
            print(f"\nDDP load layouts ({args.compare_shape}, 2 ranks): load s / resume s / resume RSS MB")
            for store in stores:
                for layout in args.layouts:
                    r = measure(args.compare_shape, 2, "ddp", url(store), env, layout=layout, repeats=1)
                    print(f"- {store} {layout}: {r['restore_s']:.2f} / {r['resume_s']:.2f} / {r['resume_rss_mb']:,.0f}",
                          flush=True)
        if not args.no_recovery:
            r = recovery(Path(tmp), args.corpus, args.recovery_model)
            print(f"\nrecovery (2 workers, {args.recovery_model}, snapshot every 20 steps, "
                  f"SIGKILL at step {r['killed_at_step']}): "
                  f"{r['recovery_s']:.1f} s to the first resumed step, resumed from step {r['resumed_from_step']}, "
                  f"{r['steps_lost']} steps lost")
        if server is not None:
            server.stop()
