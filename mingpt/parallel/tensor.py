"""Tensor parallelism inside a node (Megatron's split, with DTensor's parallel styles): each block's
q, k, v and MLP input projections are split by columns (each process computes its own heads and
its own quarter of the MLP's hidden units) and the two output projections by rows. Between them the
residual stream is split by tokens (sequence parallelism): the norms, the dropouts and the residual
adds each work on 1/N of the sequence, an all-gather brings the whole sequence to a sub-layer and a
reduce-scatter takes its output back to each process's tokens (the same bytes as Megatron's one
all-reduce). The token embedding and the LM head tied to it are split by vocabulary, and so are the
logits, into the loss (`loss_parallel`); the position embedding stays whole. `parallel.parallelize`
applies it before FSDP takes the data-parallel dimensions of the mesh.

What the rest of mingpt sees does not change: the seam (`Parallel`) asks this module for the
gradient norm over every shard, and for snapshot slots in the layout a run without tensor
parallelism has: a split tensor is gathered over the group (row cuts are all the layout knows),
and written back into the split after a load.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.model.plan import BLOCK, BLOCKS, TOP
from mingpt.parallel.shards import rows_of
from mingpt.snapshot.layout import Slot


def problem(cfg, size: int, per_node: list[int]) -> str | None:
    """Why this model (a resolved GPTConfig) or these nodes cannot take a tensor-parallel degree of
    `size`, in one line; None if they can."""
    if cfg.n_head % size:
        return (f"trainer.tensor_parallel={size} does not divide model.n_head={cfg.n_head}: each process "
                "needs whole attention heads; choose a divisor of n_head")
    if cfg.block_size % size:
        return (f"trainer.tensor_parallel={size} does not divide data.block_size={cfg.block_size}: the processes "
                "of a group split the sequence evenly between the sub-layers; choose a block size it divides")
    if cfg.padded_vocab_size % size:
        return (f"trainer.tensor_parallel={size} does not divide the vocabulary ({cfg.vocab_size} tokens, padded to "
                f"{cfg.padded_vocab_size}): the processes of a group split it evenly; choose a divisor of 64")
    bad = sorted({n for n in per_node if n % size})
    if bad:
        return (f"trainer.tensor_parallel={size} does not divide the processes per node ({bad[0]} here): "
                "a tensor-parallel group stays inside one node; set --nproc_per_node to a multiple of it")
    return None


def split(gpt: nn.Module, mesh) -> None:
    """Apply the model's plan (model/plan.py) to `gpt` over the 1-D mesh `mesh`, the stream between
    the sub-layers split by tokens (a row-split layer's bias stays whole: it is added once, after the
    sum), and the tied token embedding and LM head by vocabulary rows: the logits stay split by
    vocabulary into the loss (`loss_parallel`, entered by `TensorParallel`). A sequence the group
    cannot split evenly is padded at its end (the earlier positions never see it: attention is
    causal; its targets do not count) and cut back: `_pad_to_the_group`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # Gathering a tensor split twice (FSDP's rows of a tensor-parallel split) for a snapshot warns at
    # every save that its two all-gathers "may give inconsistent results": that is true of sums, not
    # of gathers, which copy bytes.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tokens, whole = Shard(1), Replicate()

    def gather(*rest):  # a sub-layer's input: the whole sequence (all-gather; its backward a reduce-scatter)
        # kept a DTensor, so that the partial input gradients of its split layers (q, k and v) add up
        # before one reduce-scatter, instead of an all-reduce each
        return PrepareModuleInput(input_layouts=(tokens, *rest), desired_input_layouts=(whole, *rest),
                                  use_local_output=False)

    styles = {"colwise": ColwiseParallel, "rowwise": lambda: RowwiseParallel(output_layouts=tokens),
              "sequence": lambda: SequenceParallel(use_local_output=True),
              "vocab rows": lambda: RowwiseParallel(input_layouts=whole, output_layouts=tokens),
              "positions": lambda: PrepareModuleOutput(output_layouts=whole, desired_output_layouts=Shard(0),
                                                       use_local_output=True),
              "vocab columns": lambda: ColwiseParallel(input_layouts=tokens, output_layouts=Shard(-1),
                                                       use_local_output=False)}
    plan = {name: styles[kind]() for name, kind in TOP.items()}
    for i in range(len(getattr(gpt, BLOCKS))):
        # attention takes (x, cache, layer): only x is split; the MLP takes x alone
        plan |= {f"{BLOCKS}.{i}.{name}": gather(*((None, None) if name == "attn" else ())) if kind == "gather"
                 else styles[kind]() for name, kind in BLOCK.items()}
    parallelize_module(gpt, mesh, plan)
    gpt.tie_weights()  # each style made its own split parameter of the tied matrix: one again
    cfg = gpt.config
    if cfg.padded_vocab_size > cfg.vocab_size:
        gpt.real_vocab = MaskedVocab(cfg.vocab_size, cfg.padded_vocab_size, mesh)
    _pad_to_the_group(gpt, mesh.size(), mesh.get_local_rank())


def _pad_to_the_group(gpt: nn.Module, size: int, rank: int) -> None:
    """Hooks that pad a sequence the group cannot split evenly at its end (the earlier positions never
    see it: attention is causal; its targets do not count) and cut the logits back; and give each
    process its own dropout noise."""
    cut: list[int] = []

    def pad(module, args, kwargs):
        if module.training and module.config.dropout > 0:
            # Every random draw is now on this process's own part (its tokens, its heads): each process of the
            # group draws its own dropout noise, from the micro-batch's seed and its place in the group.
            torch.manual_seed((torch.initial_seed() + rank) & 0x7FFF_FFFF_FFFF)
        extra = -args[0].size(1) % size
        cut[:] = [args[0].size(1)] if extra else []
        if not extra:
            return None
        args = [F.pad(a, (0, extra), value=0 if i == 0 else -100) if torch.is_tensor(a) else a
                for i, a in enumerate(args)]
        if torch.is_tensor(kwargs.get("targets")):
            kwargs = {**kwargs, "targets": F.pad(kwargs["targets"], (0, extra), value=-100)}
        return tuple(args), kwargs

    def unpad(module, args, kwargs, out):  # noqa: ARG001 - hook signature
        logits, loss = out
        # the loss of the split logits is whole once its parts are added (a lazy all-reduce)
        return logits[:, :cut[0]] if cut else logits, loss.full_tensor() if loss is not None else None

    gpt.register_forward_pre_hook(pad, with_kwargs=True)
    gpt.register_forward_hook(unpad, with_kwargs=True)


class MaskedVocab(nn.Module):
    """The padded columns of logits split by vocabulary get -inf (no probability, no gradient)
    instead of being sliced off, which would gather the logits whole."""

    def __init__(self, size: int, padded: int, mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        mask = torch.zeros(padded)
        mask[size:] = float("-inf")
        self.mask = distribute_tensor(mask, mesh, [Shard(0)])  # not a buffer: no state to save

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.mask


class TensorParallel:
    """This process's tensor-parallel group. Every parameter is a DTensor over the whole mesh (FSDP2
    takes the data dimensions, see `parallel.parallelize`), whose placements say what is split."""

    def __init__(self, mesh, world: int):
        from torch.distributed.tensor.parallel import loss_parallel

        self.size, self.rank, self.world = mesh.size(), mesh.get_local_rank(), world
        # For the life of the split model (its forwards and backwards, training and evaluation):
        # the cross-entropy of logits split by vocabulary adds its parts without gathering them.
        self._loss = contextlib.ExitStack()
        self._loss.enter_context(loss_parallel())

    def close(self) -> None:
        self._loss.close()

    def clip_grad_norm(self, gpt: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to max_norm (0: no clipping); the norm of the whole model's gradient, which no process
        holds: the sum of every process's `squares`, by one all-reduce over the world."""
        squares = self.squares(list(gpt.parameters()))
        dist.all_reduce(squares)
        norm = squares.sqrt()
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in gpt.parameters():
                if p.grad is not None:
                    p.grad.to_local().mul_(scale.to(p.grad.dtype))
        return norm

    def squares(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The squares of this process's parts of the gradients of `params` added up, each weighted by
        1 / the processes holding the same values (see `_copies`)."""
        squares = torch.zeros((), dtype=torch.float32)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local()
                squares = squares.to(g.device) + g.float().pow(2).sum() / self._copies(p)
        return squares

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
