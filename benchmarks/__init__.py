"""Benchmarks, one module each: `python -m benchmarks NAME [options]` from the root of a checkout."""

import contextlib
import ctypes
import random
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


_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def free_port() -> int:
    """A TCP port free on loopback now, and not one this process was given before: the kernel may hand
    out the same free port twice in a row, and two members given one port wait for each other's."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_port_runs(n: int, length: int = 1) -> list[int]:
    """`n` first ports of `length` consecutive TCP ports each, all free on loopback now and apart, below
    the kernel's ephemeral range (replica groups of `length` processes: process i listens on its group's
    port + i; a port an outgoing connection may take would refuse a restarted group its own)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng, firsts = random.Random(), []
    while len(firsts) < n:
        first = rng.randrange(max(1024, low - 12000), low - length)
        if any(abs(first - q) < length for q in firsts):
            continue
        with contextlib.ExitStack() as held:
            try:
                for p in range(first, first + length):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
        firsts.append(first)
    return firsts
