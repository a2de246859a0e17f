"""Corpora at scale: prepare throughput, start-up time and memory against dataset size, and
training throughput reading shards from S3 against local disk.

    python -m benchmarks data [--ranks-file ../shared/data/r50k_base.tiktoken] [--sizes 10MB,1GB,10GB]
                                [--s3-sizes 10MB,1GB] [--prepare-mb 512]

Synthetic text (words of tiny Shakespeare in random order, when ../shared/data has it) is written
to a temporary directory, prepared with GPT-2's BPE, and removed at the end. S3 is a real S3
server on loopback (SeaweedFS, its objects on this machine's disk). Each start is a real
`python -m mingpt.main` process training one step of a small
model; its time is launch to exit, and its peak RSS is the process's maximum resident set.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mingpt.data.prepare import Settings, prepare
from mingpt.model.tokenizer import build_bpe
from mingpt.training.metrics import read_records

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODEL = ["model=gpt-micro", "data.block_size=256", "trainer.batch_size=8", "trainer.micro_batch_size=8",
         "trainer.eval_every=0", "trainer.progress=false", "snapshot.every_steps=0", "snapshot.resume=never",
         "trainer.threads=1"]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise SystemExit(f"size {text!r}: use e.g. 10MB or 1GB")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def write_text(path: Path, nbytes: int, seed: int = 0) -> None:
    """nbytes of lines of random words, from blocks of 4 MiB in random order (fast to write)."""
    source = SHARED / "tinyshakespeare.txt"
    words = sorted(set(source.read_text().split())) if source.exists() else [f"w{i}" for i in range(5000)]
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(8):
        picks = rng.choice(len(words), 800_000)
        lines = [" ".join(words[j] for j in picks[i : i + 12]) for i in range(0, len(picks), 12)]
        blocks.append(("\n".join(lines) + "\n").encode()[: 4 * 2**20])
    blocks = [b[: b.rfind(b"\n") + 1] for b in blocks]
    written = 0
    with open(path, "wb") as fh:
        while written < nbytes:
            block = blocks[int(rng.integers(len(blocks)))][: nbytes - written]
            fh.write(block)
            written += len(block)


def prepare_throughput(tmp: Path, mb: int, ranks: str | None) -> list[tuple[str, float]]:
    text_path = tmp / "prepare.txt"
    write_text(text_path, mb * 2**20, seed=1)
    tok, rows = build_bpe(ranks), []
    with open(text_path, encoding="utf-8") as fh:  # at most 128 MiB: the call's Python list takes ~40x the text
        text = fh.read(min(mb, 128) * 2**20)
    t0 = time.perf_counter()
    tok.enc.encode_ordinary(text)
    rows.append(("one encode_ordinary call, 1 thread", len(text.encode()) / 2**20 / (time.perf_counter() - t0)))
    del text
    for workers in (1, 2):
        out = tmp / f"prepared-{workers}"
        t0 = time.perf_counter()
        prepare([str(text_path)], str(out), Settings(unit_bytes=16 * 2**20), ranks_file=ranks, workers=workers)
        rows.append((f"mingpt-prepare, {workers} process{'es' if workers > 1 else ''}", mb / (time.perf_counter() - t0)))
        shutil.rmtree(out)
    text_path.unlink()
    return rows


def start(data_path: str, cache: Path, run_dir: Path, ranks: str | None, extra: list[str] = (), env=None,
          more: list[str] = ()) -> dict:
    """One real training process: seconds from launch to exit, peak RSS (MiB), and its run
    directory (whose metrics give the steady-state tokens/s of a longer run)."""
    cmd = [sys.executable, "-m", "mingpt.main", *MODEL, *more, f"data.path={data_path}", f"data.cache_dir={cache}",
           "data.tokenizer.kind=bpe", f"trainer.run_dir={run_dir}", *([f"data.tokenizer.ranks_file={ranks}"] if ranks
                                                                       else []), *extra]
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: nobody reads a pipe while we wait
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        if status != 0:
            err.seek(0)
            raise SystemExit(f"training failed: {err.read().decode(errors='replace')[-2000:]}")
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024, "run_dir": run_dir}


def steady_tokens_per_s(run_dir: Path, skip: int) -> float:
    rows = read_records(run_dir / "metrics.jsonl")
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > skip]
    return float(np.median(rates))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    default_ranks = SHARED / "r50k_base.tiktoken"
    ap.add_argument("--ranks-file", default=str(default_ranks) if default_ranks.exists() else None)
    ap.add_argument("--sizes", default="10MB,1GB,10GB", help="text sizes for start-up (local)")
    ap.add_argument("--s3-sizes", default="10MB,1GB", help="text sizes for start-up from S3")
    ap.add_argument("--prepare-mb", type=int, default=512, help="text for the prepare throughput (MiB; 0: skip it)")
    ap.add_argument("--repeats", type=int, default=3, help="starts per size and place (the median is shown)")
    ap.add_argument("--steps", type=int, default=60, help="steps for the S3 against local throughput")
    ap.add_argument("--tmp", default=None, help="where the synthetic text and datasets go (default: system temp)")
    ap.add_argument("--model", nargs="*", default=[], help=f"overrides after the training runs' own ({' '.join(MODEL)})")
    args = ap.parse_args(argv)
    ranks = args.ranks_file
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp_name:
        tmp = Path(tmp_name)
        if args.prepare_mb:
            print(f"prepare throughput, {args.prepare_mb} MiB of text, GPT-2 BPE, {os.cpu_count()} cores:", flush=True)
            for name, mbs in prepare_throughput(tmp, args.prepare_mb, ranks):
                print(f"  {name:<40} {mbs:7.1f} MiB/s", flush=True)

        from benchmarks.seaweed import SeaweedFS

        (tmp / "weed").mkdir()
        server = SeaweedFS(tmp / "weed")
        server.start()
        os.environ.update(server.env)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        print("\nlaunch to the end of step 1 and peak RSS, one process (gpt-micro, 8 x 256 tokens):", flush=True)
        print(f"  {'text':>8} {'tokens':>14} {'prepare':>9}  {'where':<6} {'seconds':>8} {'peak RSS':>10}", flush=True)
        s3_sizes = {parse_size(s) for s in args.s3_sizes.split(",") if s}
        biggest = None
        for size_text in [s for s in args.sizes.split(",") if s]:
            size = parse_size(size_text)
            text_path, out = tmp / "corpus.txt", tmp / f"ds-{size_text}"
            write_text(text_path, size, seed=2)
            t0 = time.perf_counter()
            m = prepare([str(text_path)], str(out), Settings(), ranks_file=ranks, workers=0)
            prep_s = time.perf_counter() - t0
            text_path.unlink()
            where = [("local", str(out))]
            if size in s3_sizes:
                fs.put(str(out) + "/", f"bench/{size_text}/", recursive=True)
                where.append(("s3", f"s3://bench/{size_text}"))
            for name, path in where:  # the median of a few starts: one start varies by about a second
                runs = [start(path, tmp / f"cache-{name}-{size_text}", tmp / f"run-{name}-{size_text}-{i}", ranks,
                              ["trainer.max_steps=1"], env, args.model) for i in range(args.repeats)]
                r = sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2]
                print(f"  {size_text:>8} {m['tokens']:>14,} {prep_s:8.0f}s  {name:<6} {r['seconds']:8.2f} "
                      f"{r['rss_mib']:8.0f} MiB", flush=True)
            if size in s3_sizes:
                biggest = (size_text, str(out))
            else:
                shutil.rmtree(out)
        if biggest is not None:
            size_text, out = biggest
            print(f"\nsteady-state training throughput, {size_text} dataset, {args.steps} steps "
                  "(median tokens/s after step 10):", flush=True)
            rates = {}
            for name, path in (("local", out), ("s3", f"s3://bench/{size_text}")):
                cache = tmp / f"cache-steady-{name}"
                r = start(path, cache, tmp / f"run-steady-{name}", ranks,
                          [f"trainer.max_steps={args.steps}", "trainer.log_every=1"], env, args.model)
                rates[name] = steady_tokens_per_s(r["run_dir"], 10)
                print(f"  {name:<6} {rates[name]:10,.0f} tokens/s", flush=True)
            print(f"  S3 / local: {rates['s3'] / rates['local']:.3f}")
        server.stop()


if __name__ == "__main__":
    main()
