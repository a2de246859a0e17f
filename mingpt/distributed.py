"""The one place that reads torchrun's environment; the process group; reductions.

Everything else receives rank, world size and device as arguments (see `DistInfo`).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, read once at start.

    RANK is not stable: torchrun reassigns it on every restart, so nothing that outlives the
    process may be keyed on it. `restart_count` may differ between nodes in the same round, so
    it is for logs only.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    hostname: str = "localhost"
    device: str = "cpu"

    @property
    def is_first(self) -> bool:
        """The single writer and logger of the job: the current global rank 0."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, cuda: bool | None = None) -> "DistInfo":
        env = os.environ if env is None else env
        cuda = torch.cuda.is_available() if cuda is None else cuda
        local_rank = int(env.get("LOCAL_RANK", 0))
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=local_rank,
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            hostname=socket.gethostname(),
            device=f"cuda:{local_rank}" if cuda else "cpu",
        )


def die_with_parent() -> None:
    """Under torchrun, make the kernel SIGKILL this worker when its agent dies.

    torchrun starts workers in their own session, so a SIGKILLed agent would leave orphans that
    keep training at the old world size (and hold the cores). Linux only; a no-op elsewhere.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def init(info: DistInfo, timeout_s: float) -> None:
    """Set the device and join the process group (nothing to do for a single process)."""
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
    if info.distributed and not dist.is_initialized():
        kwargs = {"device_id": torch.device(info.device)} if info.backend == "nccl" else {}
        dist.init_process_group(
            backend=info.backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )


def shutdown() -> None:
    """Destroy the process group; call on every exit path so workers exit cleanly."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - already exiting; do not mask the original error
            log.warning("destroying the process group failed: %s", e)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place (identity without a process group)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_floats(values: list[float], device: str) -> list[list[float]]:
    """Every rank's list of floats (same length on all ranks), indexed by current rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def all_gather_objects(obj) -> list:
    """Every rank's picklable object, indexed by current rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from rank src to all ranks."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def default_threads(local_world_size: int) -> int:
    """Intra-op threads that never oversubscribe the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


class PreemptionFlag:
    """Set by SIGTERM (torchrun forwards it on shutdown; SLURM sends it before a kill) or SIGUSR1
    (`sbatch --signal`). The handler only records the request: the ranks agree on it at the next
    step boundary, save once and exit, so no rank hangs waiting for one that was not signalled."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self, signums=(signal.SIGTERM, signal.SIGUSR1)) -> "PreemptionFlag":
        for s in signums:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signum = signum
