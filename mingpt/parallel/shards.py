"""The rows of a tensor that each rank holds: FSDP2's cut (torch.chunk's rule), which the snapshot
layout follows too, and the copy of a whole tensor into a parameter that may be such a shard."""

from __future__ import annotations

import torch


def rows_of(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [start, stop) of part i when n rows are cut into `parts` parts of ceil(n / parts) rows
    (the last parts may be shorter or empty): the rule of torch.chunk, which FSDP2 shards by."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(start + size, n)


def own_part(t: torch.Tensor) -> torch.Tensor:
    """A tensor as this process holds it: a DTensor's own part (FSDP2's rows, a tensor-parallel
    split), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """Rows [start, stop) of dimension 0 that this rank holds of an FSDP2 DTensor: `rows_of` over the
    mesh dimension it is sharded on (HSDP: the second; the first replicates)."""
    dim = next(i for i, p in enumerate(t.placements) if p.is_shard())
    return rows_of(int(t.shape[0]) if t.dim() else 1, t.device_mesh.size(dim), t.device_mesh.get_local_rank(dim))


def assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the leading rows of a whole tensor, `full`, into a parameter: a plain tensor, or a
    DTensor (FSDP2's rows, cut by torch.chunk's rule, and/or a tensor-parallel split) that takes
    just its own part."""
    with torch.no_grad():
        if hasattr(param, "device_mesh") and tuple(full.shape) == tuple(param.shape):  # a DTensor, any split
            from torch.distributed.tensor import distribute_tensor

            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        elif hasattr(param, "device_mesh"):  # FSDP's rows, of which `full` gives the leading ones
            local, (start, _) = param.to_local(), local_rows(param)
            rows = max(0, min(len(full) - start, len(local)))
            local[:rows].copy_(full[start:start + rows])
        else:
            param[: len(full)].copy_(full)
