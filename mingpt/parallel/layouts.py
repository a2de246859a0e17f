"""How the model is spread over the ranks, behind one seam: `parallelize` builds it (DDP, FSDP2,
HSDP or a single process, chosen by `trainer.parallel`) and the returned `Parallel` is all the
Trainer knows of it: the module to call, gradient sync during accumulation, clipping, the compute
timing, and the tensors a snapshot saves and loads.

HSDP is FSDP2 on a 2-D device mesh: the parameters are sharded over the processes of one node and
replicated across the nodes, so the all-gathers and reduce-scatters stay inside a node and only the
all-reduce of each rank's gradient shard with its copies (the same local rank on every other
node) crosses the link between nodes.

The model arrives built on the meta device (no memory, no initialisation). It is wrapped first,
then materialised on the device, then initialised by `GPT.init_weights` (values that depend on the
seed alone, whatever the strategy), so that under FSDP no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings

import torch
import torch.nn as nn

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.parallel.pipeline import Pipeline
from mingpt.parallel.pipeline import problem as pp_problem
from mingpt.parallel.shards import local_rows, own_part
from mingpt.parallel.tensor import TensorParallel, split
from mingpt.parallel.tensor import problem as tp_problem
from mingpt.runtime.distributed import DistInfo
from mingpt.snapshot.layout import Slot, n_rows

log = logging.getLogger(__name__)

class Parallel:
    """One strategy's answers to the Trainer's questions; see `parallelize`."""

    def __init__(self, name: str, model: nn.Module, gpt: GPT, copies: int = 1, shards: int = 1,
                 tp: TensorParallel | None = None, rank: int = 0, world: int = 1, pp: Pipeline | None = None):
        self.name, self.model, self.gpt, self.pp = name, model, gpt, pp
        self.sharded = name in ("fsdp", "hsdp") or tp is not None  # tensor parallel: FSDP2 for the data (parallelize)
        self.nodes = copies  # HSDP: the nodes, each a copy of the whole state sharded over its ranks
        self.shards, self.tp = shards, tp
        # The data-parallel coordinates: the processes of one tensor-parallel group train one share
        # of the global batch together, so they count as one rank of the data split; so do the stages
        # of a pipeline (ranks stage-major: rank = stage * per_stage + rank in the stage).
        n, self.stages = (tp.size if tp else 1), (pp.stages if pp else 1)
        per_stage = world // self.stages
        stage, in_stage = divmod(rank, per_stage)
        self.data_rank, self.data_world, self.data_copies = in_stage // n, per_stage // n, n * self.stages
        # A snapshot's writers (snapshot/layout.py `cut`): every rank writes; the processes of a
        # tensor-parallel group hold the same rows once gathered, like HSDP's copies, so under
        # FSDP they split those rows between them (writer = copy * shards + shard); each stage's
        # processes write that stage's tensors.
        self.writer, self.copies = rank, copies
        if tp:
            node_copy, shard = divmod(self.data_rank, shards)
            self.copies = copies * n
            self.writer = stage * per_stage + (node_copy * n + tp.rank) * shards + shard
        # The strategy runs a step's micro-batches itself, in its schedule's order (`accumulate`), and
        # evaluates through `evaluator` (called as the GPT: model(x, y, reduction=...)).
        self.orders_micro_batches = pp is not None
        self.local = pp.module if pp else gpt  # what this process holds and trains: the optimizer's parameters
        self.evaluator = pp.evaluator() if pp else gpt
        # This rank's own compute time per step ends when the gradient reaches the token embedding,
        # the last computation of the backward pass: the gradient all-reduce that follows makes
        # every rank look as slow as the slowest. (A tensor hook, not a DDP comm hook: a Python
        # comm hook leaves a Python callback on the process group's C++ threads, which abort the
        # process if they drop it while the interpreter shuts down.)
        self.grads_ready_t = 0.0
        self._hook = gpt.wte.register_forward_hook(self._watch_embedding)

    def __str__(self) -> str:
        tp = f" x tensor parallel {self.tp.size}" if self.tp else ""
        tp += f" x {self.pp}" if self.pp else ""
        if self.name != "hsdp":
            return self.name + tp
        return f"hsdp ({self.nodes} node{'s' if self.nodes > 1 else ''} x {self.shards} processes{tp})"

    def layout(self) -> dict:  # what a manifest records of it (the pipeline's stages: the snapshotter's)
        return {"parallel": self.name, "tensor_parallel": self.tp.size if self.tp else 1}

    def _watch_embedding(self, module, args, out) -> None:  # noqa: ARG002 - hook signature
        if out.requires_grad:
            out.register_hook(self._note_grads_ready)

    @torch.compiler.disable  # a clock read cannot be traced: compiled, the forward breaks here once
    def _note_grads_ready(self, grad) -> None:  # noqa: ARG002 - hook signature
        self.grads_ready_t = time.perf_counter()

    def sync(self, last: bool):
        """The context of one micro-batch's backward: gradients are reduced across ranks only after
        the last micro-batch of a step."""
        if self.pp:  # its schedule runs every micro-batch of the step (accumulate)
            return contextlib.nullcontext()
        if self.name == "ddp" and not self.tp and not last:
            return self.model.no_sync()
        if self.sharded:
            self.gpt.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of the whole model to max_norm (0: no clipping); their global norm, on
        the device (reading it on the host would wait for the step)."""
        if self.pp:  # (with tensor parallelism inside its stages too)
            return self.pp.clip_grad_norm(max_norm)
        if self.tp:
            return self.tp.clip_grad_norm(self.gpt, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), max_norm if max_norm > 0 else math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def slots(self, optimizer: torch.optim.Optimizer) -> list[Slot]:
        """Every tensor of the model and the optimizer as this rank holds it, by a name that does not
        depend on the strategy: `model.<parameter>`, `optim.<parameter>.<state>`."""
        def slot(name: str, t: torch.Tensor) -> Slot:
            return (self.tp and self.tp.slot(name, t)) or _slot(name, t)

        if self.pp:  # every stage's, the others' as placeholders (a collective the first time)
            return self.pp.slots(optimizer, slot)
        return [slot(name, t) for name, t in self._tensors(optimizer)]

    def held(self, optimizer: torch.optim.Optimizer) -> list[Slot]:
        """The tensors of `slots`, by the same names, exactly as this process holds them (its FSDP rows,
        its tensor-parallel part; nothing gathered): for a process that holds the same parts (healing)."""
        if self.pp:
            raise ParallelError("a pipeline's processes cannot heal from replica groups (refused in the config)")
        return [Slot(name, mine, tuple(mine.shape)) for name, t in self._tensors(optimizer) for mine in [own_part(t)]]

    def _tensors(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        names = {}
        out = []
        if self.sharded:  # after a forward without backward (evaluation) the root may still be whole
            for m in self.gpt.modules():
                if hasattr(m, "reshard"):
                    m.reshard()
        with torch.no_grad():
            for name, p in self.gpt.named_parameters():
                names[p] = name
                out.append((f"model.{name}", p.detach()))
            for group in optimizer.param_groups:
                for p in group["params"]:
                    out.extend((f"optim.{names[p]}.{k}", v.detach()) for k, v in optimizer.state[p].items())
        return out

    def aliases(self) -> dict[str, str]:
        """State-dict names that are another parameter (tied weights): {alias: name}."""
        first, out = {}, {}
        for name, p in self.gpt.named_parameters(remove_duplicate=False):
            if p in first:
                out[f"model.{name}"] = f"model.{first[p]}"
            else:
                first[p] = name
        return out

    def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor, float]], scale) -> torch.Tensor:
        """Forward and backward of one rank's micro-batches (x, y, weight) of a step, in the strategy's
        own order (`orders_micro_batches`), each micro-batch's summed token loss through `scale` before
        its backward; the gradients reduced across ranks. Its summed token loss, weighted."""
        loss = self.pp.run(batches, scale)
        self.grads_ready_t = time.perf_counter()
        return loss

    def close(self) -> None:
        self._hook.remove()
        if self.pp:
            self.pp.close()
        if self.tp:
            self.tp.close()


def _slot(name: str, t: torch.Tensor) -> Slot:
    t = t.detach()
    if hasattr(t, "device_mesh"):  # an FSDP2 shard: rows [start, stop) of dimension 0
        local, (start, stop) = t.to_local(), local_rows(t)
        if n_rows(local.shape) != stop - start or not local.is_contiguous():
            raise RuntimeError(f"{name}: FSDP holds {tuple(local.shape)} here, not rows {start}-{stop}")
        dim = next(i for i, p in enumerate(t.placements) if p.is_shard())
        # a mesh dimension of one (DDP across tensor-parallel groups): every rank holds every row
        return Slot(name, local, tuple(t.shape), start, sharded=t.device_mesh.size(dim) > 1)
    return Slot(name, t, tuple(t.shape))


def _materialise(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` without its cost: on meta tensors `empty_like` runs through torch._refs,
    whose first use imports sympy and more (0.45 s of every start)."""
    new: dict[int, torch.Tensor] = {}  # a tensor shared by two modules stays shared
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    new[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[name] = new[id(t)]


class ParallelError(ValueError):
    """A world the chosen strategy cannot run on; the message says what to use instead."""


def mesh_shape(places: list[tuple[int, int, int]], one_node_ok: bool) -> tuple[int, int]:
    """(nodes, processes per node) of HSDP's mesh from every rank's (torchrun node, local rank, rank),
    indexed by rank. Every node must hold the same number of processes, each node's ranks
    consecutive (torchrun numbers them so); one node is FSDP and is refused unless `one_node_ok` (a
    run that lost its other nodes carries on as one copy)."""
    per_node: dict[int, list[tuple[int, int]]] = {}
    for node, local, rank in places:
        per_node.setdefault(node, []).append((local, rank))
    sizes = sorted({len(ranks) for ranks in per_node.values()})
    if len(sizes) > 1:
        counts = ", ".join(str(len(per_node[n])) for n in sorted(per_node))
        raise ParallelError(f"trainer.parallel=hsdp needs the same number of processes on every node, these nodes "
                            f"hold {counts}: give every node the same --nproc_per_node, or use trainer.parallel=fsdp")
    nodes, size = len(per_node), sizes[0]
    if nodes == 1 and not one_node_ok:
        raise ParallelError(f"trainer.parallel=hsdp on one node ({size} processes) is FSDP: use trainer.parallel=fsdp, "
                            "or start on several nodes")
    for ranks in per_node.values():
        if len({rank // size for _, rank in ranks}) != 1 or any(rank % size != local for local, rank in ranks):
            raise ParallelError("trainer.parallel=hsdp needs each node's ranks to be consecutive (torchrun numbers "
                                "them so): launch with torchrun, or use trainer.parallel=fsdp")
    return nodes, size


def data_shape(places: list[tuple[int, int, int]], strategy: str, tp: int, stages: int,
               one_node_ok: bool) -> tuple[int, int]:
    """(replicate, shard): the data dimensions of one pipeline stage's processes (all of them, without
    a pipeline), from every rank's (torchrun node, local rank, rank). DDP replicates over every data
    rank, FSDP shards over them; HSDP shards within a node and replicates across the nodes, so each
    stage must hold whole nodes (ranks are stage-major); one node a stage is FSDP and is refused unless
    `one_node_ok` (see `mesh_shape`)."""
    data = len(places) // tp // stages
    if strategy != "hsdp":
        return (data, 1) if strategy == "ddp" else (1, data)
    nodes, size = mesh_shape(places, one_node_ok or stages > 1)
    if nodes % stages:
        raise ParallelError(f"trainer.parallel=hsdp with trainer.pipeline_parallel={stages} needs whole nodes in each "
                            f"stage, these {nodes} node(s) of {size} processes do not split into {stages}: start a "
                            f"multiple of {stages} nodes, or use trainer.parallel=fsdp")
    if nodes == stages > 1 and not one_node_ok:
        raise ParallelError(f"trainer.parallel=hsdp with trainer.pipeline_parallel={stages} over {nodes} nodes puts "
                            "each stage on one node, which is FSDP: use trainer.parallel=fsdp, or start more nodes")
    return nodes // stages, size // tp


def device_mesh(info: DistInfo, strategy: str, tp: int, model: GPTConfig, one_node_ok: bool, stages: int = 1):
    """The mesh of the data dimensions "replicate" (across nodes) and "shard" (within a node), see
    `data_shape`, with a last dimension "tp" of `tp` consecutive ranks of one node where tensor
    parallelism splits the blocks, and a first dimension "pp" of `stages` where a pipeline does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mine = torch.tensor([info.node, info.local_rank, info.rank], device=info.device)
    every = [torch.empty_like(mine) for _ in range(info.world_size)]
    dist.all_gather(every, mine)
    places = [tuple(t.tolist()) for t in every]
    if tp > 1:
        counts = {}
        for node, _, _ in places:
            counts[node] = counts.get(node, 0) + 1
        problem = tp_problem(model, tp, list(counts.values()))
        if problem:
            raise ParallelError(problem)
        if any(places[r][0] != places[r - r % tp][0] for r in range(info.world_size)):
            raise ParallelError("trainer.tensor_parallel needs each node's ranks to be consecutive (torchrun numbers "
                                "them so): launch with torchrun")
    shape = data_shape(places, strategy, tp, stages, one_node_ok)
    if strategy == "hsdp" and shape[0] == 1 and info.is_rank0:
        log.warning("HSDP on one node%s: carrying on as one copy (FSDP over %d processes) until another node "
                    "joins", " a stage" if stages > 1 else "", shape[1] * tp)
    names = ("pp",) * (stages > 1) + ("replicate", "shard") + ("tp",) * (tp > 1)
    shape = (stages,) * (stages > 1) + shape + (tp,) * (tp > 1)
    return init_device_mesh(torch.device(info.device).type, shape, mesh_dim_names=names)


def parallelize(gpt: GPT, strategy: str, info: DistInfo, *, seed: int | None, compile: bool = False,
                one_node_ok: bool = False, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                schedule: str = "1f1b", micro_batches=None) -> Parallel:
    """Wrap a model built on the meta device for `strategy` ("ddp", "fsdp" or "hsdp"; one process
    runs it plainly) and `tensor_parallel` (the processes that split each block; 1: none),
    materialise it on this rank's device, and initialise it from `seed` (None: leave it
    uninitialised, for a snapshot that overwrites every value). `one_node_ok`: see `mesh_shape`.
    `pipeline_parallel` > 1: the blocks in that many stages, run by `schedule`; `micro_batches(data
    world)`: the micro-batches of a data rank a step (a schedule may need more).

    With tensor parallelism FSDP2 takes the data dimensions under every strategy (DDP as FSDP2 over
    a mesh whose "shard" dimension is 1: replicated, as DDP's, with gradients all-reduced), so every
    split parameter is one DTensor over the whole mesh."""
    device = torch.device(info.device)
    if pipeline_parallel > 1:
        return _pipeline(gpt, info, strategy, pipeline_parallel, tensor_parallel, schedule, micro_batches, seed,
                         one_node_ok)
    copies, shards, tp = 1, 1, None
    if tensor_parallel > 1 and not info.distributed:
        raise ParallelError(f"trainer.tensor_parallel={tensor_parallel} needs that many processes: launch with "
                            f"torchrun --nproc_per_node={tensor_parallel} (or a multiple of it)")
    mesh = None
    if info.distributed and (strategy == "hsdp" or tensor_parallel > 1):
        mesh = device_mesh(info, strategy, tensor_parallel, gpt.config, one_node_ok)
    if tensor_parallel > 1:
        split(gpt, mesh["tp"])
        tp = TensorParallel(mesh["tp"], info.world_size)
    if (strategy in ("fsdp", "hsdp") or tp) and info.distributed:
        data_mesh = mesh["replicate", "shard"] if mesh is not None else None
        copies, shards = (data_mesh.size(0), data_mesh.size(1)) if mesh is not None else (1, info.world_size)
        _shard(gpt, gpt.blocks, data_mesh, device)
    else:
        _materialise(gpt, device)
        gpt.tie_weights()
    name = strategy if info.distributed else "single"
    if seed is not None:
        gpt.init_weights(seed)
    model: nn.Module = torch.compile(gpt) if compile else gpt
    if name == "ddp" and not tp:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True,
            init_sync=False)  # every rank initialised the same values, or will load them
        _settle_buckets(model, gpt, device)
    return Parallel(name, model, gpt, copies, shards, tp, info.rank, info.world_size)


def _shard(root: nn.Module, blocks, mesh, device: torch.device) -> None:
    """FSDP2 over `mesh` (None: every rank): each block (one all-gather per block: only one block is
    ever whole at a time), then the rest; then materialised on `device`."""
    from torch.distributed.fsdp import fully_shard

    # The logits are a view (the padded vocabulary sliced off); nothing changes them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)
    root.to_empty(device=device)


def _settle_buckets(ddp: nn.Module, gpt: GPT, device: torch.device) -> None:
    """One backward before any step, so that every step of every start sums its gradients in the
    same buckets. DDP's first backward reduces one bucket of everything; the next forward rebuilds
    the buckets in the order the gradients became ready. Over three ranks or more the order of a sum
    changes its last bits ((a + b) + c is not a + (b + c)), so without this the first step after a
    resume summed otherwise than the uninterrupted run did at that step, and the runs parted.
    Eager even under torch.compile (no compilation for this shape); the weights are not touched."""
    x = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.compiler.set_stance("force_eager"):
        _, loss = ddp(x, x, reduction="sum")
        loss.backward()
    gpt.zero_grad(set_to_none=True)


def _pipeline(gpt: GPT, info: DistInfo, strategy: str, stages: int, tensor_parallel: int, schedule: str,
              micro_batches, seed: int | None, one_node_ok: bool) -> Parallel:
    """`stages` pipeline stages over the processes, stage-major, data-parallel across the pipelines (as
    DDP, or each stage sharded over its copies by FSDP2 or HSDP: `strategy`), each stage's blocks split
    by tensor parallelism where `tensor_parallel` > 1: this process's stage materialised and
    initialised (the same values as one process's: every parameter is drawn, the other stages' into
    meta tensors that hold nothing)."""
    if not info.distributed:
        raise ParallelError(f"trainer.pipeline_parallel={stages} needs that many processes: launch with torchrun "
                            f"--nproc_per_node={stages} (or a multiple of it)")
    per_stage, tp = info.world_size // stages, tensor_parallel
    problem = pp_problem(gpt.config, stages, info.world_size, schedule,
                         micro_batches(max(per_stage // tp, 1)) if micro_batches else stages)
    if problem:
        raise ParallelError(problem)
    import torch.distributed as dist

    device = torch.device(info.device)
    mesh = device_mesh(info, strategy, tp, gpt.config, one_node_ok, stages)
    split_tp = None
    if tp > 1:  # before the stages are cut: each takes the GPT's split modules
        split(gpt, mesh["tp"])
        split_tp = TensorParallel(mesh["tp"], per_stage)
    stage, in_stage = divmod(info.rank, per_stage)
    tied = None
    for d in range(per_stage):  # every process joins the creation of every group, in one order
        group = dist.new_group([d, (stages - 1) * per_stage + d])
        tied = group if d == in_stage else tied
    sharded = strategy != "ddp" or split_tp is not None  # tensor parallel: FSDP2 for the data (as parallelize)
    pp = Pipeline(gpt, stage, stages, schedule, device, mesh.get_group("pp"),
                  None if sharded else mesh.get_group("replicate"), tied, per_stage, split_tp)
    pp.sharded = sharded
    copies, shards = mesh["replicate"].size(), mesh["shard"].size()
    if sharded:  # each stage's parts as the FSDP path shards the GPT
        data_mesh = mesh["shard"] if strategy == "fsdp" and not split_tp else mesh["replicate", "shard"]
        for part in pp.parts:
            _shard(part, part.blocks.values(), data_mesh, device)
    else:
        _materialise(pp.module, device)
    # the tied matrix: one parameter again where this stage holds either end of it
    if not gpt.wte.weight.is_meta:
        gpt.lm_head.weight = gpt.wte.weight
    elif not gpt.lm_head.weight.is_meta:
        gpt.wte.weight = gpt.lm_head.weight
    if seed is not None:
        gpt.init_weights(seed)
    return Parallel(strategy, pp.module, gpt, copies if sharded else 1, shards if sharded else 1, split_tp,
                    rank=info.rank, world=info.world_size, pp=pp)
