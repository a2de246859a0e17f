"""Benchmarks, one module each: `python -m benchmarks NAME [options]` from the root of a checkout."""

import ctypes
import signal
import socket
from pathlib import Path


def die_with_bench() -> None:
    """preexec_fn of a torchrun agent a benchmark starts: the kernel SIGKILLs it when the benchmark
    dies, however (a SIGTERM skips the benchmark's own cleanup), and its workers die with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def alive(pids: list[int]) -> list[int]:
    """Those of these processes that still run (zombies, waiting for their parent, do not)."""
    out = []
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(p)
        except OSError:
            continue
    return out


def children(pid: int) -> list[int]:
    """The processes `pid` started (a torchrun agent's: its workers); none once it has ended."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
