"""A fault soak on a real S3 server (SeaweedFS on loopback): a 2-worker job saving its snapshots to
S3 is SIGKILLed again and again, a worker (torchrun restarts the workers) or the whole agent with
its workers (relaunched with the same command, as a scheduler would), most kills while a multipart
upload is in flight. The job must end with weights and optimizer state bitwise equal to the same
job run without faults, and the bucket must hold no unfinished multipart upload and nothing but
committed snapshots.

    python -m benchmarks soak [--faults 20] [--steps 150] [--every 5] [--seed 0]
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

from benchmarks import alive, children, die_with_bench
from benchmarks.seaweed import SeaweedFS
from mingpt.snapshot.restore import read_newest

REPO = Path(__file__).resolve().parents[1]
# 12.7M parameters: 152 MB of state, 76 MB a writer: a multipart upload of 3 parts per writer
MODEL = ["model=custom", "model.n_layer=4", "model.n_head=4", "model.n_embd=512", "data.block_size=32",
         "trainer.batch_size=4", "trainer.micro_batch_size=2"]


def agent(store: str, run_dir: Path, corpus: str, steps: int, every: int, model: list[str], env: dict):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1000",
           "--monitor-interval=0.5", "-m", "mingpt.main", *model, f"trainer.max_steps={steps}", "trainer.log_every=5",
           "trainer.eval_every=0", "trainer.progress=false", f"snapshot.every_steps={every}", f"snapshot.dir={store}",
           "snapshot.keep_last=2", f"trainer.run_dir={run_dir}", f"data.path={corpus}",
           f"data.cache_dir={run_dir.parent / 'cache'}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(run_dir / "console.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_bench)


def outlived(pids: list[int], wait_s: float = 5.0) -> int:
    """How many of these processes are still alive (not zombies) after wait_s; they are killed."""
    deadline = time.time() + wait_s
    while time.time() < deadline and alive(pids):
        time.sleep(0.05)
    left = alive(pids)
    for p in left:
        os.kill(p, signal.SIGKILL)
    return len(left)


def uploading(store) -> bool:
    try:
        return bool(store.uploads())
    except Exception:  # noqa: BLE001 - busy
        return False


def tensors(state: dict) -> dict:
    """The weights and the optimizer's moments of a state read whole (SnapshotStore.load), by name."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({f"optim.{p}.{k}": v for p, m in state["optimizer"].items() for k, v in m.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=5, help="snapshot every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--agent-share", type=float, default=0.4, help="the share of faults that kill the whole agent")
    ap.add_argument("overrides", nargs="*", help="the model and batch instead of the default 12.7M-parameter one")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    model = args.overrides or MODEL
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "weed").mkdir()
        server = SeaweedFS(tmp / "weed")
        server.start()
        os.environ.update(server.env)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        import s3fs

        from mingpt.snapshot import SnapshotStore

        s3fs.S3FileSystem().mkdir("soak")
        try:
            t0 = time.time()
            ref = agent("s3://soak/ref", tmp / "ref", args.corpus, args.steps, args.every, model, env)
            if ref.wait() != 0:
                raise SystemExit("the uninterrupted job failed:\n" + (tmp / "ref" / "console.log").read_text()[-3000:])
            print(f"uninterrupted job: {time.time() - t0:.0f} s", flush=True)
            store = SnapshotStore("s3://soak/faulty")
            t0, kills, orphans = time.time(), [], 0
            job = agent(store.url, tmp / "faulty", args.corpus, args.steps, args.every, model, env)
            while len(kills) < args.faults and job.poll() is None:
                time.sleep(rng.uniform(1.0, 4.0))
                deadline = time.time() + (10 if rng.random() < 0.75 else 0)
                while not uploading(store) and time.time() < deadline and job.poll() is None:
                    time.sleep(0.02)  # three kills in four wait for an upload in flight
                during = uploading(store)
                whole = rng.random() < args.agent_share
                victims = children(job.pid)
                if job.poll() is not None or (not whole and not victims):
                    continue
                if whole:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
                    orphans += outlived(victims)  # its workers must die with it, even those still starting
                    job = agent(store.url, tmp / "faulty", args.corpus, args.steps, args.every, model, env)
                else:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                kills.append(("agent" if whole else "worker", during))
                print(f"fault {len(kills)}: SIGKILL of the {kills[-1][0]}{' during an upload' if during else ''}",
                      flush=True)
            if job.wait() != 0:
                raise SystemExit("the job under faults failed:\n"
                                 + (tmp / "faulty" / "console.log").read_text()[-3000:])
            wall = time.time() - t0
            want, _ = read_newest(SnapshotStore("s3://soak/ref"))
            got, manifest = read_newest(store)
            a, b = tensors(want), tensors(got)
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            unfinished = store.uploads()
            fs = s3fs.S3FileSystem()
            fs.invalidate_cache()
            committed = {s.path.rstrip("/").rsplit("/", 1)[-1] for s in store.list() if s.committed}
            stray = [p for p in fs.find("soak/faulty") if p.split("/")[2] not in committed]
            during = sum(d for _, d in kills)
            print(f"\n{len(kills)} faults ({sum(k == 'worker' for k, _ in kills)} workers, "
                  f"{sum(k == 'agent' for k, _ in kills)} whole agents; {during} during an upload), {wall:.0f} s")
            print(f"final step {manifest['step']}: weights and optimizer state "
                  f"{'bitwise equal' if same else 'DIFFERENT'} to the uninterrupted job ({len(a)} tensors)")
            print(f"workers that outlived their SIGKILLed agent: {orphans}")
            print(f"unfinished multipart uploads left: {len(unfinished)}; objects outside committed snapshots: "
                  f"{len(stray)}" + (f" ({stray[:3]})" if stray else ""))
            if not same or orphans or unfinished or stray:
                raise SystemExit(1)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
