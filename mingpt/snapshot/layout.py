"""How a snapshot's tensors are divided among its writers, and the slots a rank reads and writes.

Every tensor of the training state (weights and optimizer moments) is cut along its first dimension
into as many row ranges as there are writers, by FSDP's own rule (ceil(n / writers) rows each), and
writer w writes range w of every tensor into its shard file. So each byte is written once, the
writers' files are the same size to within a row per tensor, and a rank of an FSDP run writes
exactly the rows it holds. Under HSDP the nodes are copies of the model holding the same rows: each
shard's range is cut again into one part per copy (see `cut`). The cut depends only on the tensors'
names, shapes and dtypes and on the numbers of writers and copies: every rank computes the same
one, and the manifest records them.

A `Slot` is one tensor as one rank holds it: all its rows (replicated: DDP, or one process) or
its own range of rows (sharded: FSDP). Loading fills every slot's rows from whichever writers'
pieces cover them, so a snapshot written by N ranks loads at any world size, into either strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mingpt.parallel.shards import rows_of  # the one cut rule, FSDP2's (torch.chunk's)

SHARD_FORMAT = "shard-{:05d}-of-{:05d}.bin"
EXTRA_FILE = "extra.pt"


def n_rows(shape) -> int:
    """A tensor's rows: its first dimension, or 1 for a scalar."""
    return int(shape[0]) if len(shape) else 1


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor seen as (rows, bytes per row) of uint8; a scalar is one row."""
    rows = n_rows(t.shape)
    return t.reshape(-1).view(torch.uint8).reshape(rows, -1) if t.numel() else t.reshape(rows, 0).view(torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Slot:
    """One tensor of the training state as this rank holds it: rows [start, start + len(local))."""
    name: str
    local: torch.Tensor  # contiguous; all rows (replicated) or this rank's range (sharded)
    shape: tuple[int, ...]  # the whole tensor's shape
    start: int = 0
    sharded: bool = False
    load_back: Callable[[], None] | None = None
    """Set when `local` is a copy (gathered from a tensor-parallel split): after a load, copies it into
    the tensor it stands for. Every rank calls its slots' in the same order (it may communicate)."""
    stage: int = 0
    """The pipeline stage whose processes write it (`cut`); 0 without a pipeline. A tensor that this
    process does not hold (another stage's) has a `local` on the meta device: a placeholder."""

    @property
    def held(self) -> bool:
        """This process holds the tensor (it is no other pipeline stage's placeholder)."""
        return not self.local.is_meta

    @property
    def stop(self) -> int:
        return self.start + n_rows(self.local.shape)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.local.element_size()


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one tensor, at `offset` in writer `writer`'s shard file."""
    writer: int
    offset: int
    start: int
    stop: int


def cut(specs: list[tuple[str, tuple[int, ...], torch.dtype]], writers: int, copies: int = 1,
        stages: int = 1, stage_of: dict[str, int] | None = None) -> tuple[dict[str, list[Piece]], list[int]]:
    """({tensor name: its pieces}, each writer's file size) for tensors given as (name, shape, dtype),
    in the order given (the same on every rank).

    `copies` > 1 (HSDP): writer w is rank w of a mesh of `copies` rows of writers // copies shards
    (w = copy * shards + shard); each tensor is cut into the shards' row ranges, and each shard's
    range into one part per copy, so the copies of a shard write its rows once between them, each
    about the same number of bytes.

    `stages` > 1 (a pipeline): the writers are `stages` consecutive groups, and each tensor is cut as
    above among the writers of its stage (`stage_of`) alone: each stage writes its own tensors."""
    per_stage = writers // stages
    shards = per_stage // copies
    sizes = [0] * writers
    pieces: dict[str, list[Piece]] = {}
    for name, shape, dtype in specs:
        rows = n_rows(shape)
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        base = (stage_of or {}).get(name, 0) * per_stage
        pieces[name] = []
        for s in range(shards):
            first, last = rows_of(rows, shards, s)
            for r in range(copies):
                start, stop = rows_of(last - first, copies, r)
                w = base + r * shards + s
                if stop > start:
                    pieces[name].append(Piece(w, sizes[w], first + start, first + stop))
                    sizes[w] += (stop - start) * row_bytes
    return pieces, sizes


def specs_of(slots: list[Slot]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(s.name, tuple(s.shape), s.local.dtype) for s in slots]


def layout_name(manifest: dict) -> str:
    """A snapshot's layout as the resume line and `mingpt-snapshot show` name it: the data layout, then
    tensor parallelism and the pipeline's stages where there are."""
    tp, stages = manifest.get("tensor_parallel", 1), manifest.get("stages", 1)
    return (manifest.get("parallel", "ddp") + (f" x tensor parallel {tp}" if tp > 1 else "")
            + (f" x pipeline {stages}" if stages > 1 else ""))
