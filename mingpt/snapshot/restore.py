"""Loading a snapshot into the live tensors of every rank at once, at any world size and into either
strategy, falling back to the previous snapshot when one is damaged.

Each rank reads in parallel only what it needs, straight into its own tensors (no second copy of
the state), and checks every piece it reads against the manifest's sha256:
- a sharded tensor (FSDP): the pieces that overlap the rows it holds;
- a replicated tensor (DDP, one process), `exchange` layout: the pieces of writer w are read by
  rank w mod world and broadcast to the others (a tensor collective; nothing is pickled);
- a replicated tensor, `direct` layout: every rank reads every piece itself.
The ranks agree on success before anything moves between them, so a damaged shard makes every
rank give up on that snapshot together and try the previous one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from mingpt.snapshot.layout import Piece, Slot, as_rows
from mingpt.snapshot.store import MismatchError, SnapshotError, SnapshotStore, read_pieces, nothing_loads

log = logging.getLogger("mingpt")

STAGING_BYTES = 256 * 2**20  # the pinned host buffer that pieces bound for an accelerator pass through


def restore(store: SnapshotStore, path: str, manifest: dict, slots: list[Slot], *, rank: int, world: int,
            layout: str = "exchange", cache=None,
            stage: bool | None = None, staging_bytes: int = STAGING_BYTES) -> dict:
    """Fill every slot from the committed snapshot `path`; returns its small state (sampler,
    counters, GradScaler). Raises SnapshotError, on every rank alike, naming the damaged shard.

    Pieces of tensors on an accelerator (`stage`: None decides by the device) are read through one
    reused pinned buffer of `staging_bytes` (or the largest piece), never the whole state at once."""
    entries = manifest["tensors"]
    problems = [f"{s.name} is not in it" for s in slots if s.name not in entries]
    problems += [f"{s.name} is {entries[s.name]['shape']} in it, {list(s.shape)} here" for s in slots
                 if s.name in entries and entries[s.name]["shape"] != list(s.shape)]
    if problems:
        raise SnapshotError(f"snapshot {path} does not fit this model and optimizer: {'; '.join(problems[:5])}")
    jobs, staged, later, sends = [], [], [], []
    for slot in slots:
        rows = as_rows(slot.local)
        into = staged if (rows.device.type != "cpu" if stage is None else stage) else jobs
        for piece in map(Piece.from_json, entries[slot.name]["pieces"]):
            if not slot.sharded and layout == "exchange" and world > 1:
                reader = piece.writer % world
                sends.append((slot, piece, reader))
                if reader == rank:
                    into.append((slot.name, piece, rows[piece.start:piece.stop]))
                continue
            start, stop = max(piece.start, slot.start), min(piece.stop, slot.stop)
            if start >= stop:
                continue
            if (start, stop) == (piece.start, piece.stop):
                into.append((slot.name, piece, rows[start - slot.start:stop - slot.start]))
            else:  # a piece that straddles this rank's rows is read whole (on the host), to check it
                whole = torch.empty((piece.stop - piece.start, rows.shape[1]), dtype=torch.uint8)
                jobs.append((slot.name, piece, whole))
                later.append((rows[start - slot.start:stop - slot.start], whole[start - piece.start:stop - piece.start]))
    errors = read_pieces(store, path, manifest, jobs, cache) + _read_staged(store, path, manifest, staged, cache,
                                                                            staging_bytes)
    try:
        extra = store.read_extra(path, manifest)
    except Exception as e:  # noqa: BLE001 - any failure to read it makes the snapshot unusable
        errors.append(f"{e.__class__.__name__}: {e}")
    _agree(errors, path, world)
    for dst, src in later:
        dst.copy_(src)
    for slot, piece, reader in sends:
        dist.broadcast(as_rows(slot.local)[piece.start:piece.stop], src=reader)
    return extra


def _staging_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _read_staged(store: SnapshotStore, path: str, manifest: dict, jobs: list, cache, limit: int) -> list[str]:
    """Read pieces bound for device rows through one host buffer, a buffer-full at a time; the
    messages of the damaged pieces."""
    if not jobs:
        return []
    sizes = [dst.numel() for _, _, dst in jobs]
    buf = _staging_buffer(min(max(limit, *sizes), sum(sizes)))
    errors, i = [], 0
    while i < len(jobs):
        group, used = [], 0
        while i < len(jobs) and (not group or used + sizes[i] <= buf.numel()):
            name, piece, dst = jobs[i]
            group.append((name, piece, dst, buf[used:used + sizes[i]].view(dst.shape)))
            used, i = used + sizes[i], i + 1
        errors += read_pieces(store, path, manifest, [(n, p, host) for n, p, _, host in group], cache)
        for _, _, dst, host in group:
            dst.copy_(host, non_blocking=True)
        if buf.is_pinned():
            torch.cuda.synchronize()  # the copies out of the buffer are done before it is refilled
    return errors


def _agree(errors: list[str], path: str, world: int) -> None:
    """Raise on every rank if any rank met a problem (each problem named once)."""
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, errors)
        errors = sorted({e for errs in everyone for e in errs})
    if errors:
        raise SnapshotError(f"snapshot {path} is damaged: {'; '.join(errors[:5])}"
                            + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))


def restore_newest(store: SnapshotStore, candidates: list[tuple[str, dict]], load: Callable[[str, dict], dict],
                   check: Callable[[dict], None]) -> tuple[dict, dict]:
    """(manifest, small state) of the first candidate (path, manifest; newest first) that `load`
    fills without a problem, warning for each one it passes over; `check` refuses a snapshot of
    another model. Every rank calls this with the same candidates and passes over the same ones."""
    errors = []
    for path, manifest in candidates:
        try:
            check(manifest)
            return manifest, load(path, manifest)
        except MismatchError:
            raise
        except SnapshotError as e:
            log.warning("snapshot %s cannot be loaded (%s); falling back to the previous one", path, e)
            errors.append(f"{path}: {e}")
    raise nothing_loads(store.url, '; '.join(errors))
