"""The S3 transport's knobs against a real S3 server (SeaweedFS on loopback, disk-backed): the write
path by part size and parts in flight (s3fs's client and boto3's transfer manager), the read path
by the longest ranged GET and GETs in flight, for one object of a snapshot shard's size; and what
this machine's disk gives (dd with fsync), so the figures can be scaled to another machine.

    python -m benchmarks s3tune [--mb 512] [--parts 8 16 32 64] [--in-flight 2 4 8 16]
        [--reads 32 64 128 256] [--gets 1 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.seaweed import SeaweedFS


def disk_mb_s(directory: Path, mb: int) -> float:
    """Sequential write with fsync at the end (dd conv=fsync), MB/s."""
    out = subprocess.run(["dd", "if=/dev/zero", f"of={directory / 'dd.bin'}", "bs=1M", f"count={mb}", "conv=fsync"],
                         capture_output=True, text=True, check=True).stderr
    (directory / "dd.bin").unlink()
    return mb / float(out.strip().splitlines()[-1].split(" s, ")[0].rsplit(", ", 1)[-1])


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks s3tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="the object's size (a gpt2 DDP shard of 2 writers: 712 MB)")
    ap.add_argument("--parts", nargs="+", type=int, default=[8, 16, 32, 64], help="part sizes, MiB")
    ap.add_argument("--in-flight", nargs="+", type=int, default=[2, 4, 8, 16], help="parts in flight")
    ap.add_argument("--reads", nargs="+", type=int, default=[32, 64, 128, 256], help="longest ranged GET, MiB")
    ap.add_argument("--gets", nargs="+", type=int, default=[1, 2, 4, 8], help="GETs in flight")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    from mingpt.snapshot import s3
    from mingpt.snapshot.chunks import CHUNK_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "weed").mkdir()
        print(f"disk (dd, 1 MiB blocks, fsync at the end): {disk_mb_s(tmp, min(args.mb, 1024)):,.0f} MB/s")
        server = SeaweedFS(tmp / "weed")
        server.start()
        os.environ.update(server.env)
        try:
            objects = s3.S3Objects("s3://tune", {})
            objects.fs.mkdir("tune")
            data = torch.randint(0, 256, (args.mb * 2**20,), dtype=torch.uint8).numpy()
            mb = data.nbytes / 1e6
            print(f"\nwrite {mb:,.0f} MB: MB/s (best of {args.repeats})")
            print("| part MiB | " + " | ".join(f"{n} in flight s3fs" for n in args.in_flight) + " | boto3, 8 threads |")
            print("| --- |" + " --- |" * (len(args.in_flight) + 1))
            for part in args.parts:
                s3.PART_BYTES = part * 2**20
                row = []
                for n in args.in_flight:
                    objects.concurrency, objects.uploader = n, "s3fs"
                    row.append(mb / best_of(args.repeats, lambda: objects.put("tune/obj", data)))
                objects.concurrency, objects.uploader = 8, "boto3"
                row.append(mb / best_of(args.repeats, lambda: objects.put("tune/obj", data)))
                print(f"| {part} | " + " | ".join(f"{v:,.0f}" for v in row) + " |", flush=True)
            s3.PART_BYTES = 32 * 2**20
            objects.uploader, objects.concurrency = "s3fs", 8
            objects.put("tune/obj", data)
            buf = torch.empty(args.mb * 2**20, dtype=torch.uint8).numpy()
            view = memoryview(buf)
            requests = [("tune/obj", i, view[i:i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES)]
            print(f"\nread {mb:,.0f} MB as {len(requests)} chunks of 4 MiB: MB/s (best of {args.repeats})")
            print("| longest GET MiB | " + " | ".join(f"{n} GETs in flight" for n in args.gets) + " |")
            print("| --- |" + " --- |" * len(args.gets))
            for read in args.reads:
                s3.READ_BYTES = read * 2**20
                row = []
                for n in args.gets:
                    s3.GETS_IN_FLIGHT = n
                    row.append(mb / best_of(args.repeats, lambda: objects.fill(requests)))
                print(f"| {read} | " + " | ".join(f"{v:,.0f}" for v in row) + " |", flush=True)
            assert bytes(buf[:1 << 20]) == bytes(data[:1 << 20]) and bytes(buf[-1 << 20:]) == bytes(data[-1 << 20:])
        finally:
            server.stop()


if __name__ == "__main__":
    main()
