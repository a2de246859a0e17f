"""The GPU path on one CUDA device, in one go: flash attention, bf16 and fp16, torch.compile,
tokens/s and MFU of gpt2, a SIGKILLed worker resumed from its snapshot, FSDP2, generation.

    python -m benchmarks gpu --ranks-file ../shared/data/r50k_base.tiktoken [--out DIR]

Each check runs real torchrun processes on the first GPU and is independent of the others (one that
fails is reported and the next runs). Prints a table last; every process's output goes to
DIR/gpu.log and the figures to DIR/gpu.json. A machine with one GPU cannot run NCCL between ranks
(NCCL refuses two ranks on one device): the multi-rank paths are covered on gloo by the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import children
from mingpt.snapshot.restore import read_newest

REPO = Path(__file__).resolve().parents[1]
FAULT_CFG = ["data.block_size=256", "trainer.batch_size=32", "trainer.micro_batch_size=16",
             "trainer.max_steps=60", "trainer.log_every=1", "trainer.eval_every=0", "trainer.progress=false",
             "optim.warmup_steps=10", "model.dropout=0.1", "snapshot.every_steps=10"]


class Checks:
    def __init__(self, out: Path, ranks_file: str | None):
        self.out, self.ranks_file = out, ranks_file
        self.log = open(out / "gpu.log", "a")  # closed by main's with
        self.results: dict[str, dict] = {}

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        self.log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        self.log.flush()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        self.log.write(proc.stdout + proc.stderr + f"\n===== {name}: rc {proc.returncode} in "
                       f"{time.perf_counter() - t0:.1f} s\n")
        self.log.flush()
        return proc

    def check(self, name: str, fn, *args) -> None:
        print(f"--- {name}", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn(*args)
        except Exception as e:  # noqa: BLE001 - a failed check is reported and the next one runs
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        res["s"] = round(time.perf_counter() - t0, 1)
        self.results[name] = res
        print(json.dumps(res), flush=True)
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1))


def torchrun(*args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            f"--max-restarts={max_restarts}", *args]


def environment() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"ok": True, "torch": torch.__version__, "cuda": torch.version.cuda, "device": props.name,
            "capability": f"{props.major}.{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1),
            "nccl": str(torch.cuda.nccl.version()), "bf16": torch.cuda.is_bf16_supported()}


def flash_attention() -> dict:
    """Our attention block, forward and backward in bf16, with only the flash kernel allowed."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mingpt.model.gpt import CausalSelfAttention, GPTConfig

    cfg = GPTConfig(preset="gpt2", block_size=1024, vocab_size=50257).resolved()
    attn = CausalSelfAttention(cfg).cuda()
    x = torch.randn(4, 1024, 768, device="cuda", requires_grad=True)
    out = {}
    for name, backends in (("flash", [SDPBackend.FLASH_ATTENTION]), ("math", [SDPBackend.MATH])):
        with sdpa_kernel(backends), torch.autocast("cuda", torch.bfloat16):
            y = attn(x)
            y.float().square().mean().backward()
        out[name] = y.float()
    rel = ((out["flash"] - out["math"]).norm() / out["math"].norm()).item()
    return {"ok": rel < 2e-2, "flash_vs_math_rel_err": rel}


def throughput(checks: Checks, extra: list[str], steps: int) -> dict:
    cfg = ["model=gpt2", "data=shakespeare_bpe", f"data.tokenizer.ranks_file={checks.ranks_file}",
           "data.block_size=1024", *extra]
    cmd = torchrun("-m", "benchmarks", "throughput", "--json", "--steps", str(steps), "--warmup", "5", *cfg)
    # the log names every graph break and recompilation of a compiled run
    proc = checks.run("throughput " + " ".join(extra), cmd, timeout=240, env={"TORCH_LOGS": "recompiles,graph_breaks"})
    if proc.returncode != 0:
        return {"ok": False, "rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-800:]}
    return {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}


def train(checks: Checks, name: str, run_dir: Path, cfg: list[str], kill_at: int | None = None) -> dict:
    """A torchrun job of one GPU worker; with kill_at, its worker is SIGKILLed once that step is
    logged and torchrun restarts it from the snapshot."""
    from mingpt.training.metrics import read_records

    cmd = torchrun("mingpt/main.py", *cfg, f"trainer.run_dir={run_dir}", max_restarts=1 if kill_at else 0)
    if kill_at is None:
        proc = checks.run(name, cmd, timeout=150)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        checks.log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 150
        while time.time() < deadline and agent.poll() is None:
            if metrics.exists() and any(r.get("step", 0) >= kill_at for r in read_records(metrics)):
                for pid in children(agent.pid):  # its one worker
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        out, _ = agent.communicate(timeout=150)
        rc = agent.returncode
        checks.log.write(out + f"\n===== {name}: rc {rc}\n")
    recs = read_records(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    losses = {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}
    resumes = [r["step"] for r in recs if r.get("kind") == "resume"]
    return {"ok": rc == 0, "rc": rc, "losses": losses, "resumed_at": resumes, "tail": "" if rc == 0 else out[-800:]}


def final_model(run_dir: Path) -> dict:
    from mingpt.snapshot import SnapshotStore

    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    return {"step": manifest["step"], "model": state["model"]}


def compare(a: Path, b: Path) -> dict:
    import torch

    wa, wb = final_model(a), final_model(b)
    diff = max((wa["model"][k].float() - wb["model"][k].float()).abs().max().item() for k in wa["model"])
    equal = all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    return {"steps": [wa["step"], wb["step"]], "bitwise": equal, "max_abs_diff": diff}


def faults(checks: Checks, tmp: Path, model: str, precision: str, deterministic: bool = True) -> dict:
    """Fault-free twice (is the GPU run deterministic at all?) and once SIGKILLed at step 25."""
    cfg = [*FAULT_CFG, f"model={model}", f"trainer.precision={precision}", f"trainer.deterministic={deterministic}"]
    tag = f"{precision}{'' if deterministic else '-nondet'}"
    runs = {name: train(checks, f"{tag} {name}", tmp / f"{tag}-{name}", cfg, kill_at)
            for name, kill_at in (("ref", None), ("ref2", None), ("killed", 25))}
    res = {"ok": all(r["ok"] for r in runs.values()), "resumed_at": runs["killed"]["resumed_at"]}
    for name, r in runs.items():
        if not r["ok"]:
            res[f"{name}_tail"] = r["tail"]
    if res["ok"]:
        ref = runs["ref"]["losses"]
        res["ref_vs_ref2"] = compare(tmp / f"{tag}-ref", tmp / f"{tag}-ref2")
        res["killed_vs_ref"] = compare(tmp / f"{tag}-ref", tmp / f"{tag}-killed")
        res["loss_first_and_last"] = [ref[min(ref)], ref[max(ref)]]
        res["loss_curves_equal"] = {n: runs[n]["losses"] == ref for n in ("ref2", "killed")}
    return res


def fsdp(checks: Checks, tmp: Path, model: str) -> dict:
    """FSDP2 on one GPU, then its snapshot continued under DDP."""
    cfg = [*(c for c in FAULT_CFG if not c.startswith("trainer.max_steps")), f"model={model}"]
    a = train(checks, "fsdp", tmp / "fsdp", [*cfg, "trainer.parallel=fsdp", "trainer.max_steps=30"])
    if not a["ok"]:
        return a
    b = train(checks, "fsdp then ddp", tmp / "fsdp", [*cfg, "trainer.parallel=ddp", "trainer.max_steps=40"])
    return {"ok": b["ok"], "resumed_at": b["resumed_at"], "loss_30_40": [a["losses"].get(30), b["losses"].get(40)],
            "tail": b["tail"]}


def generate(checks: Checks, run_dir: Path) -> dict:
    out = {}
    for name, extra in (("cache", []), ("no_cache", ["--no-cache"])):
        t0 = time.perf_counter()
        proc = checks.run(f"generate {name}", [sys.executable, "-m", "mingpt.cli.generate", str(run_dir),
                                               "--max-new-tokens", "500", "--device", "cuda", *extra], timeout=120)
        out[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        if proc.returncode != 0:
            return {"ok": False, "tail": proc.stderr[-800:]}
        out["sample_head"] = proc.stdout[:300]
    return {"ok": True, **out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks-file", required=True, help="a local r50k_base.tiktoken (GPT-2's BPE ranks)")
    ap.add_argument("--out", default="gpu-check", help="folder for gpu.log and gpu.json")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per throughput row")
    ap.add_argument("--fault-model", default="gpt-mini", help="the model of the fault and FSDP checks")
    ap.add_argument("--precision", default="bf16", help="of the first fault check (the second is fp16)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and (args.only is None or {"environment", "flash_attention", "generate"} & set(args.only)):
        sys.exit("error: no CUDA device here; this benchmark measures the GPU path (on a CPU, --only faults fsdp "
                 "runs those checks on the CPU)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="mingpt-gpu-")  # the runs' snapshots: private, removed at the end
    tmp = Path(scratch.name)
    checks = Checks(out, str(Path(args.ranks_file).resolve()))
    plan = [
        ("environment", environment),
        ("flash_attention", flash_attention),
        ("faults", faults, checks, tmp, args.fault_model, args.precision),
        ("faults_nondeterministic", faults, checks, tmp, args.fault_model, args.precision, False),
        ("throughput_eager", throughput, checks, ["trainer.batch_size=16", "trainer.micro_batch_size=16"], args.steps),
        ("throughput_eager_deterministic", throughput, checks,
         ["trainer.batch_size=16", "trainer.micro_batch_size=16", "trainer.deterministic=true"], args.steps),
        ("throughput_compile", throughput, checks,
         ["trainer.batch_size=16", "trainer.micro_batch_size=16", "trainer.compile=true"], args.steps),
        ("faults_fp16", faults, checks, tmp, args.fault_model, "fp16"),
        ("fsdp", fsdp, checks, tmp, args.fault_model),
        ("generate", generate, checks, tmp / f"{args.precision}-ref"),
        ("throughput_compile_accum", throughput, checks,
         ["trainer.batch_size=64", "trainer.micro_batch_size=32", "trainer.compile=true"], args.steps // 2),
    ]
    with scratch, checks.log:
        for name, fn, *fargs in plan:
            if args.only is None or name in args.only:
                checks.check(name, fn, *fargs)
    print("\n| check | ok | figures |\n| --- | --- | --- |")
    for name, res in checks.results.items():
        figures = {k: v for k, v in res.items() if k not in ("ok", "tail", "sample_head") and not k.endswith("_tail")}
        print(f"| {name} | {res['ok']} | {json.dumps(figures)[:400]} |")


if __name__ == "__main__":
    main()
