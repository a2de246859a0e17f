"""Check a cluster before a long job: run it under torchrun with the job's own arguments, on every node.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_endpoint=HOST1:29500 ... -m mingpt.cli.doctor model=gpt2 \\
        trainer.run_dir=runs/run1 snapshot.dir=s3://bucket/run1

Prints one table: the start-up checks of every job (code, versions, config, corpus, one snapshot
store for all nodes, devices), the network interface each node uses, all-reduce latency and
bandwidth (between every pair of nodes when there are more than two), and the snapshot store's
write / read / delete speed. Exits 1 when the job would fail, 0 when it would start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import statistics
import struct
import sys
import time
import uuid

import torch
import torch.distributed as dist

from mingpt.config.compose import compose
from mingpt.config.schema import ConfigError
from mingpt.runtime import distributed
from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.distributed import DistInfo
from mingpt.runtime.exits import Exit, exit_process, report_error
from mingpt.runtime.preflight import run_checks
from mingpt.snapshot import SnapshotError, open_store

SIZES = (8, 1 << 20, 32 << 20)  # bytes: latency, then bandwidth


def interface_of(address: str) -> str:
    """The name of the local interface that holds `address` (Linux), else '?'."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return "?"


def network() -> str:
    """The interface and address this process reaches the job's master through, and any override."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", 29500))))  # no packet is sent
            address = s.getsockname()[0]
    except OSError as e:
        return f"cannot route to {master}: {e}"
    chosen = {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}
    return f"{interface_of(address)} {address}" + "".join(f", {k}={v}" for k, v in chosen.items())


def allreduce_times(group, device: str, repeats: int = 5) -> list[tuple[int, float, float]]:
    """(bytes, median seconds, bus GB/s) of all-reduce over `group` for each size."""
    n = dist.get_world_size(group)
    out = []
    for size in SIZES:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 2):  # two warm-up rounds
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out.append((size, med, size * 2 * (n - 1) / n / med / 1e9 if n > 1 else 0.0))
    return out


def store_speed(url: str, endpoint: str | None, megabytes: int = 32) -> str:
    store = open_store(url, endpoint)
    path = f"{store.root}/.mingpt-doctor-{uuid.uuid4().hex[:8]}"
    data = os.urandom(megabytes << 20)
    t0 = time.perf_counter()
    store.files.put(path, data)
    t1 = time.perf_counter()
    ok = store.files.get(path) == data
    t2 = time.perf_counter()
    store.files.remove(path)
    t3 = time.perf_counter()
    return (f"write {megabytes / (t1 - t0):.0f} MB/s, read {megabytes / (t2 - t1):.0f} MB/s "
            f"({'same bytes' if ok else 'DIFFERENT BYTES'}), delete {1000 * (t3 - t2):.0f} ms")


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(overrides):
        print(__doc__.strip())
        return 0
    info = DistInfo.from_env()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    try:
        cfg = compose(overrides)
    except ConfigError as e:
        return report_error(info, str(e), code=Exit.BAD_INPUT)
    distributed.init(info, cfg.dist.timeout_s)
    store_url = cfg.snapshot_store
    problems, warnings, seconds = run_checks(info, cfg.to_dict(), cfg.data.path, store_url, raise_on_problem=False)
    nets = distributed.all_gather_objects((info.hostname, info.node, info.local_rank, network()))
    nodes = sorted({(node, host) for host, node, _, _ in nets})
    lines = [f"world size {info.world_size} on {len(nodes)} node(s); checks took {seconds:.3f} s", "", "network:"]
    lines += [f"  node {node} {host}: {net}" for host, node, local, net in nets if local == 0]
    # all-reduce: the whole job, then every pair of nodes (the first process of each) when there are more than two
    groups = [("all ranks", list(range(info.world_size)), None)]
    if len(nodes) > 2:
        firsts = {node: rank for rank, (_, node, local, _) in enumerate(nets) if local == 0}
        for i, (a, _) in enumerate(nodes):
            for b, _ in nodes[i + 1 :]:
                ranks = [firsts[a], firsts[b]]
                groups.append((f"node {a} <-> node {b}", ranks, dist.new_group(ranks)))  # every rank calls it
    mine = []
    for label, ranks, group in groups:
        if info.distributed and info.rank in ranks:
            res = allreduce_times(group, info.device)
            if info.rank == ranks[0]:
                mine.append(f"  {label:<16} {1000 * res[0][1]:9.3f} ms {res[1][2]:12.2f} {res[2][2]:17.2f}")
    lines += ["", "all-reduce:        8 B latency   1 MiB bus GB/s   32 MiB bus GB/s"]
    lines += [row for rows in distributed.all_gather_objects(mine) for row in rows] or ["  (one process: nothing to measure)"]
    try:
        speed = store_speed(store_url, cfg.snapshot.endpoint_url) if info.is_rank0 else ""
    except (SnapshotError, OSError) as e:
        speed = ""
        problems.append(str(e))
    if info.is_rank0:
        lines += ["", f"snapshot store {store_url}: {speed or 'not reachable'}", ""]
        lines += [f"warning: {w}" for w in warnings]
        lines += [f"PROBLEM: {p}" for p in problems]
        lines.append("the job would fail: fix the problems above" if problems else "ok: the job would start")
        print("\n".join(lines), flush=True)
    distributed.shutdown()
    return 1 if problems else 0


if __name__ == "__main__":
    code = main()
    exit_process(code, had_process_group=DistInfo.from_env(cuda=False).distributed)
