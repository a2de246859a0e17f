"""Bytes between nodes and inside them per training step, by parallel strategy: two torchrun agents
of 2 processes each in two network namespaces joined by a veth pair (needs root); the pair's byte
counters are the traffic between the nodes, each namespace's loopback the traffic inside a node.
Each (model, strategy) runs twice, to `--steps` A and B; the difference of the two runs' bytes over
B - A steps leaves out start-up, rendezvous and the final save. A strategy `tpN-S` is S with
trainer.tensor_parallel=N (the 2 processes of a node split each block).

    python -m benchmarks internode [--models gpt-mini gpt2] [--strategies ddp fsdp hsdp tp2-ddp] [--steps 2 5]

On gloo (CPU) only here: gloo's all-reduce is a ring over the ranks, NCCL's picks rings or trees,
so the figures on GPUs differ in detail, not in which strategy sends more.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import die_with_bench
from benchmarks.netns import agent_cmd, link_bytes, two_nodes

REPO = Path(__file__).resolve().parents[1]
RANKS_FILE = REPO.parent / "shared" / "data" / "r50k_base.tiktoken"


def run(a, b, port: int, args: list[str], log: Path, timeout: float) -> tuple[int, int]:
    """One 2 x 2 job to its end; the bytes that crossed the link, and those inside the two nodes."""
    before, inside = link_bytes(a), link_bytes(a, "lo") + link_bytes(b, "lo")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = [subprocess.Popen(agent_cmd(node, a, port, 2, "mingpt/main.py", *args, nnodes="2", max_restarts=0,
                                         run_id=f"internode{port}"),
                               cwd=REPO, env={**env, "GLOO_SOCKET_IFNAME": node.veth}, stdout=open(f"{log}.{i}", "w"),
                               stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_bench)
              for i, node in enumerate((a, b))]
    deadline = time.time() + timeout
    for p in agents:
        try:
            code = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            code = -1
        if code != 0:
            for q in agents:
                q.kill()
            raise SystemExit(f"a job failed ({' '.join(args)}): see {log}.0 and {log}.1\n"
                             + Path(f"{log}.0").read_text()[-3000:])
    return link_bytes(a) - before, link_bytes(a, "lo") + link_bytes(b, "lo") - inside


def job_args(model: str, strategy: str, steps: int, tmp: Path, corpus: str, extra: list[str]) -> list[str]:
    bpe = ["data.tokenizer.kind=bpe", f"data.tokenizer.ranks_file={RANKS_FILE}"] if model.startswith("gpt2") else []
    tp, _, parallel = strategy.rpartition("-")
    return [f"model={model}", *bpe, f"trainer.parallel={parallel}", f"trainer.tensor_parallel={tp[2:] or 1}",
            f"trainer.max_steps={steps}",
            "data.block_size=64", "trainer.batch_size=4", "trainer.micro_batch_size=1", "trainer.eval_every=0",
            "trainer.log_every=1", "trainer.progress=false", "snapshot.resume=never", "snapshot.every_steps=0",
            f"data.path={corpus}", f"data.cache_dir={tmp / 'cache'}",
            f"trainer.run_dir={tmp / f'{model}-{strategy}-{steps}'}", *extra]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks internode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt-mini", "gpt2"])
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "hsdp"])
    ap.add_argument("--steps", nargs=2, type=int, default=[2, 5], metavar=("A", "B"))
    ap.add_argument("--data", default=str(REPO / "data" / "input.txt"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--tmp", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every job, e.g. model.n_layer=2")
    args = ap.parse_args(argv)
    lo, hi = args.steps
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp, two_nodes() as (a, b):
        tmp, port = Path(tmp), 29700 + os.getpid() % 200
        print(f"2 nodes x 2 processes (gloo), network namespaces joined by a veth pair; steps {lo} and {hi}")
        print("| model | strategy | MB between nodes per step | vs DDP | MB inside the nodes per step |\n"
              "| --- | --- | --- | --- | --- |")
        for model in args.models:
            per_step = {}
            for strategy in args.strategies:
                counts = []
                for steps in (lo, hi):
                    port += 1
                    counts.append(run(a, b, port, job_args(model, strategy, steps, tmp, args.data, args.overrides),
                                      tmp / f"{model}-{strategy}-{steps}.log", args.timeout))
                per_step[strategy] = (counts[1][0] - counts[0][0]) / (hi - lo)
                inside = (counts[1][1] - counts[0][1]) / (hi - lo)
                ratio = f"{per_step[strategy] / per_step['ddp']:.2f}" if "ddp" in per_step else "-"
                print(f"| {model} | {strategy} | {per_step[strategy] / 1e6:.1f} | {ratio} | {inside / 1e6:.1f} |",
                      flush=True)
        if "fsdp" in per_step and "hsdp" in per_step:
            print(f"HSDP sends {per_step['hsdp'] / per_step['fsdp']:.2f} of FSDP's bytes between nodes ({args.models[-1]})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
