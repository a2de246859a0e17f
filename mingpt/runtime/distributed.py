"""torchrun's environment as a DistInfo; the process group; reductions.

Everything else receives rank, world size and device as arguments (see `DistInfo`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from mingpt.runtime.trust import SecretError, bound_store, derive, job_secret

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
    restart_count: int = 0
    node: int = 0
    """torchrun's node rank (GROUP_RANK) in this start: which processes share a node. Like RANK it
    may change at every restart, so it is used within one start only."""
    hostname: str = "localhost"
    device: str = "cpu"
    job_id: str | None = None
    """torchrun's rendezvous id (TORCHELASTIC_RUN_ID; None outside torchrun), the same in every restart of
    a job. Users reuse one id (--rdzv_id=run1) for every launch: for the report only; decisions use `launch_id`."""
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """What tells one launch from another, the same on every node and every restart of it:
    MINGPT_LAUNCH_ID (set by mingpt-torchrun and the mingpt rendezvous from the per-job secret),
    else torchrun's rendezvous id, else an id of this process alone."""
    restarted: bool = False
    """This start is a torchrun restart of a running launch: some rank's TORCHELASTIC_RESTART_COUNT
    is above 0 (agreed over the ranks once the process group forms; the count may differ by node)."""
    torchrun: DistInfo | None = None
    """Its place as torchrun gave it, where the run sees it in another (a replica group's member); None: this one."""

    @property
    def is_rank0(self) -> bool:
        """The current global rank 0: the job's single writer and logger, whichever node it is on."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, cuda: bool | None = None) -> DistInfo:
        env = os.environ if env is None else env
        cuda = torch.cuda.is_available() if cuda is None else cuda
        local_rank = int(env.get("LOCAL_RANK", 0))
        # torchrun's default id is the literal "none": it names no job in particular.
        job_id = env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none") else None
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=local_rank,
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            node=int(env.get("GROUP_RANK", 0)),
            hostname=socket.gethostname(),
            device=f"cuda:{local_rank}" if cuda else "cpu",
            job_id=job_id,
            launch_id=env.get("MINGPT_LAUNCH_ID") or job_id or uuid.uuid4().hex[:12],
            restarted=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0,
        )


def _worker_store(info: DistInfo, timeout: datetime.timedelta):
    """The workers' own store at MASTER_ADDR:MASTER_PORT, hosted by rank 0 on that address only, its
    keys under a prefix derived from the job secret (apart from any other job's). Whoever reaches the
    port can still list, overwrite and delete its keys: mingpt reads nothing from it, and what torch
    reads there (gloo's addresses of the ranks) is unsigned, so a forged value can only make the
    group fail to form (docs/multi-node.md). None where torch's own env:// store is used."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_ADDR" not in os.environ:
        return None
    store = bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.rank == 0, timeout,
                        wait_for_workers=False)
    secret = job_secret()
    return dist.PrefixStore(derive(secret, "workers") if secret else "mingpt", store)


def init(info: DistInfo, timeout_s: float, threads: int = 0, deterministic: bool = False) -> DistInfo:
    """The process's one setup (`shutdown` is its teardown): device, intra-op threads (0: a share of the
    cores that never oversubscribes them), TF32 on GPUs, deterministic kernels if asked, the process
    group. Returns `info` with `restarted` agreed (a restart if any node's agent counts one)."""
    torch.set_num_threads(threads or default_threads(info.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if deterministic:
        # cuBLAS reduces in a fixed order only with a fixed workspace, set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
    if info.distributed and not dist.is_initialized():
        kwargs = {"device_id": torch.device(info.device)} if info.backend == "nccl" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = _worker_store(info, timeout)
            if store is not None:
                kwargs.update(store=store, rank=info.rank, world_size=info.world_size)
            dist.init_process_group(backend=info.backend, timeout=timeout, **kwargs)
        except SecretError:
            raise
        except Exception as e:  # noqa: BLE001 - a connection that never forms, of any backend
            ifname = "NCCL_SOCKET_IFNAME" if info.backend == "nccl" else "GLOO_SOCKET_IFNAME"
            raise ProcessGroupError(
                f"the {info.backend} process group of {info.world_size} ranks did not form within dist.timeout_s="
                f"{timeout_s:g} ({first_line(e)[:200]}): the ranks meet at MASTER_ADDR={os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} and then connect to each other; check that the nodes reach each "
                f"other on the interface {ifname} names (or the default route's) and that no firewall is in between"
            ) from None
    counts = all_gather_floats([info.restart_count], info.device)
    return replace(info, restarted=any(c > 0 for (c,) in counts))


def first_line(e: BaseException) -> str:
    """The first line of an error's message (C++ errors carry pages of context), or its class name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else e.__class__.__name__


class ProcessGroupError(RuntimeError):
    """The process group could not be formed; the message says what to check."""


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


def rank_names(places: list[tuple[str, int, int]]) -> list[str]:
    """Every rank's name in logs and records, from each rank's (hostname, node, local rank): "host:local_rank",
    with "(node N)" added where one host runs more than one node's processes (several agents on one
    machine: each has its local ranks 0..n, so host and local rank alone would name two processes as one).
    The node is torchrun's for this start: the names are unique within a start, not across restarts."""
    nodes: dict[str, set[int]] = {}
    for host, node, _ in places:
        nodes.setdefault(host, set()).add(node)
    return [f"{host}:{local}" + (f" (node {node})" if len(nodes[host]) > 1 else "") for host, node, local in places]


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from rank src to all ranks."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0(fn):
    """Run fn on rank 0 only and give every rank its result; an exception raised there is
    raised on every rank, so all of them stop together with the same message."""
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below, then raised
            error = e
    result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def side_group(timeout_s: float = 1800.0):
    """A gloo group of all ranks beside the training one, for the snapshot writers' background
    threads: their collectives never race the training loop's. None without a process group."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_peer_failure(e: BaseException) -> bool:
    """Whether an exception means a peer process or node went away (a collective broke)."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                            "Broken pipe", "NCCL error", "ProcessGroupNCCL"))


def lost_peer(e: BaseException, hosts: list[str], me: int = -1) -> str:
    """A broken collective in our words: which host and ranks went away (from the peer address gloo
    names, matched against `hosts`, every rank's name from `rank_names`), and how. gloo's own text names a
    source file, an ephemeral port, and sometimes "GLHF"."""
    import re

    text = str(e)
    how = next((said for pattern, said in (("reset by peer", "its connection was reset"),
                                           ("closed by peer", "it closed its connection"),
                                           ("Broken pipe", "its connection broke"),
                                           ("Timed out", "it did not answer in time"),
                                           ("NCCL", "NCCL reported an error")) if pattern in text),
               "its connection failed")
    found = re.search(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+", text)
    if not found:
        return f"a peer was lost during a collective ({how})"
    address, where = found.group(1), {}
    for rank, entry in enumerate(hosts):
        host = entry.rsplit(":", 1)[0]
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            continue
        if ip == address and rank != me:  # (on one host every rank shares the address: not this one)
            where.setdefault(host, []).append(rank)
    if not where:
        return f"the peer at {address} was lost during a collective ({how})"
    named = "; ".join(f"host {h}, rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for h, r in where.items())
    return f"lost {named} ({address}) during a collective: {how}"


def default_threads(local_world_size: int) -> int:
    """Intra-op threads that never oversubscribe the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))
