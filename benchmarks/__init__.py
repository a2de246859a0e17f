"""Benchmarks, one module each: `python -m benchmarks NAME [options]` from the root of a checkout."""

import ctypes
import signal
import socket


def die_with_bench() -> None:
    """preexec_fn of a torchrun agent a benchmark starts: the kernel SIGKILLs it when the benchmark
    dies, however (a SIGTERM skips the benchmark's own cleanup), and its workers die with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
