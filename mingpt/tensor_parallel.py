"""Tensor parallelism inside a node (Megatron's split, with DTensor's parallel styles): each block's
q, k, v and MLP input projections are split by columns (each process computes its own heads and
its own quarter of the MLP's hidden units) and the two output projections by rows, so a block costs
one all-reduce of the activations forward and one backward. Embeddings, norms and the LM head stay
whole on every process of the group. `parallel.parallelize` applies it before DDP or FSDP take the
data-parallel dimension of the mesh.

What the rest of mingpt sees does not change: the seam (`Parallel`) asks this module for the
gradient norm over every shard, and for snapshot slots in the layout a run without tensor
parallelism has: a split tensor is gathered over the group (row cuts are all the layout knows),
and written back into the split after a load.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from mingpt.shards import rows_of
from mingpt.snapshot.layout import Slot

# Megatron's plan for one GPT-2 block: "colwise" splits a Linear's output features, "rowwise" its
# input features (its input arrives split; its output is summed over the group).
PLAN = {"attn.c_q": "colwise", "attn.c_k": "colwise", "attn.c_v": "colwise", "attn.c_proj": "rowwise",
        "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}


def problem(n_head: int, size: int, per_node: list[int]) -> str | None:
    """Why this model or these nodes cannot take a tensor-parallel degree of `size`, in one line; None if they can."""
    if n_head % size:
        return (f"trainer.tensor_parallel={size} does not divide model.n_head={n_head}: each process "
                "needs whole attention heads; choose a divisor of n_head")
    bad = sorted({n for n in per_node if n % size})
    if bad:
        return (f"trainer.tensor_parallel={size} does not divide the processes per node ({bad[0]} here): "
                "a tensor-parallel group stays inside one node; set --nproc_per_node to a multiple of it")
    return None


def split(blocks: nn.ModuleList, mesh) -> None:
    """Apply PLAN to every block over the 1-D mesh `mesh` (a row-split layer's bias stays whole: it
    is added once, after the sum)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # Gathering a tensor split twice (FSDP's rows of a tensor-parallel split) for a snapshot warns at
    # every save that its two all-gathers "may give inconsistent results": that is true of sums, not
    # of gathers, which copy bytes.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh, {name: styles[kind]() for name, kind in PLAN.items()})


class TensorParallel:
    """This process's tensor-parallel group. Every parameter is a DTensor over the whole mesh (FSDP2
    takes the data dimensions, see `parallel.parallelize`), whose placements say what is split."""

    def __init__(self, mesh, world: int):
        self.size, self.rank, self.world = mesh.size(), mesh.get_local_rank(), world

    def clip_grad_norm(self, gpt: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to max_norm (0: no clipping); the norm of the whole model's gradient, which no process
        holds: each adds the squares of its own part, weighted by 1 / the processes holding the same
        values, and one all-reduce over the world sums them."""
        squares, grads = torch.zeros((), dtype=torch.float32), []
        for p in gpt.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local()
            grads.append(g)
            squares = squares.to(g.device) + g.float().pow(2).sum() / self._copies(p)
        dist.all_reduce(squares)
        norm = squares.sqrt()
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        return norm

    def _copies(self, p: torch.Tensor) -> int:
        """How many processes hold this part of `p`'s gradient: the world over the parts its mesh
        splits it into (a `_StridedShard`, FSDP's split of a split tensor, counts as a split)."""
        parts = 1
        for i, placement in enumerate(p.placements):
            parts *= 1 if placement.is_replicate() else p.device_mesh.size(i)
        return self.world // parts

    def slot(self, name: str, t: torch.Tensor) -> Slot | None:
        """The snapshot slot of tensor `t` (a parameter or its optimizer state) in the layout
        without tensor parallelism: the rows FSDP alone would give this process, cut from the whole
        tensor (gathered) into a new one, which a load fills and `Slot.load_back` copies into this
        process's part. None: `t` is not split over the group (FSDP's rows as they are, or a scalar)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        t = t.detach()
        if "tp" not in (getattr(t, "device_mesh", None) and t.device_mesh.mesh_dim_names or ()):
            return None
        whole = t.full_tensor()
        mesh = t.device_mesh
        shard_dim = mesh.mesh_dim_names.index("shard")
        start, stop = rows_of(whole.shape[0], mesh.size(shard_dim), mesh.get_local_rank(shard_dim))
        mine = whole[start:stop].clone()
        del whole

        def load_back() -> None:  # FSDP's rows (Shard(0) on "shard": torch.chunk's cut, as rows_of) -> whole -> split
            rows = [Shard(0) if i == shard_dim else Replicate() for i in range(mesh.ndim)]
            full = DTensor.from_local(mine, mesh, rows, run_check=False, shape=t.shape, stride=t.stride()).full_tensor()
            t.to_local().copy_(distribute_tensor(full, mesh, t.placements, src_data_rank=None).to_local())

        # one shard (DDP across the groups): every process holds every row, which a load may share out
        return Slot(name, mine, tuple(t.shape), start, sharded=mesh.size(shard_dim) > 1, load_back=load_back)
