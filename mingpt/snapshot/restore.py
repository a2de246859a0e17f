"""The one snapshot reader: a snapshot into the live tensors of every rank at once, at any world size
and into any layout (training passes `restore` to store.newest_that_loads; its layouts, `exchange`
and `direct`: docs/snapshots.md, "Load"), and the same read by one process into whole tensors for
the offline tools and tests (`read_whole`, `read_newest`, `load_from`).

The ranks agree on success (one all-reduce) before anything moves between them, so a damaged chunk
makes every rank give up on that snapshot together; a read that failed for a reason that may pass
(after retries) fails the start instead, with exit 1.
"""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from mingpt.snapshot.chunks import (
    BATCH_BYTES,
    Chunk,
    Copier,
    Target,
    chunks_of,
    needed,
    read_chunks,
    targets_of,
    whole_slots,
)
from mingpt.snapshot.layout import EXTRA_FILE, Slot
from mingpt.snapshot.store import (
    STEP_RE,
    DamagedError,
    SnapshotError,
    SnapshotStore,
    TransientError,
    candidates,
    newest_that_loads,
)
from mingpt.snapshot.transport import TRANSIENT, failure

log = logging.getLogger("mingpt")

EXCHANGE_BYTES = 256 * 2**20  # the flat buffer one all-gather of the exchange fills


def restore(store: SnapshotStore, path: str, manifest: dict, slots: list[Slot], *, rank: int, world: int,
            layout: str = "exchange", cache=None, exchange_bytes: int = EXCHANGE_BYTES,
            batch_bytes: int = BATCH_BYTES) -> dict:
    """Fill every slot from the committed snapshot `path`; returns its small state (sampler,
    counters, GradScaler). Raises SnapshotError, on every rank alike, naming the damaged shard."""
    entries = manifest["tensors"]
    # a pipeline's process holds its stage's tensors; the other stages' are placeholders. Its ranks
    # need different tensors, so each reads its own (no exchange of tensors every rank holds).
    pipeline = any(not s.held for s in slots)
    slots = [s for s in slots if s.held]
    problems = [f"{s.name} is not in it" for s in slots if s.name not in entries]
    problems += [f"{s.name} is {entries[s.name]['shape']} in it, {list(s.shape)} here" for s in slots
                 if s.name in entries and entries[s.name]["shape"] != list(s.shape)]
    if problems:
        raise SnapshotError(f"snapshot {store.url_of(path)} does not fit this model and optimizer: "
                            f"{'; '.join(problems[:5])}")
    targets, chunks = targets_of(manifest, slots), chunks_of(manifest)
    exchange = layout == "exchange" and world > 1 and not pipeline
    if exchange:  # the chunks of this rank's own rows, and its share of the replicated ones
        replicated = Copier([t for t in targets if t.replicated])
        shares = _shares(needed(chunks, replicated), world)
        own = needed(chunks, Copier([t for t in targets if not t.replicated]))
        to_read = sorted(set(own) | set(shares[rank]), key=lambda c: (c.file, c.start))
    else:
        to_read = needed(chunks, Copier(targets))
    sizes = {name: f["size"] for name, f in manifest["files"].items()}
    errors = read_chunks(store.files, path, to_read, Copier(targets), cache, manifest["step"], sizes, batch_bytes)
    try:
        extra = store.read_extra(path, manifest)
    except SnapshotError as e:  # its checksum
        errors.append(str(e))
    except Exception as e:  # noqa: BLE001 - any failure to read it makes the snapshot unusable
        errors.append(failure(EXTRA_FILE, e))
    _agree(errors, store.url_of(path), world, targets[0].dest.device if targets else torch.device("cpu"))
    if exchange:
        _exchange(replicated, shares, rank, world, exchange_bytes)
    for slot in slots:
        if slot.load_back is not None:
            slot.load_back()
    return extra


def read_whole(store: SnapshotStore, path: str) -> tuple[dict, dict]:
    """(state, manifest) of one committed snapshot read whole by this process, every checksum
    verified: {"model": {name: tensor}, "optimizer": {param: {key: tensor}}, "scaler", "sampler",
    "trainer"}. The offline tools' and the tests' reader: `restore` with one rank."""
    manifest = store.read_manifest(path)
    missing = store.missing_files(path, manifest)
    if missing:
        raise SnapshotError(f"snapshot {store.url_of(path)} is incomplete: {', '.join(missing)}")
    slots = whole_slots(manifest)
    state = {"model": {}, "optimizer": {}, **restore(store, path, manifest, slots, rank=0, world=1)}
    for slot in slots:
        kind, _, rest = slot.name.partition(".")
        if kind == "model":
            state["model"][rest] = slot.local
        else:
            param, _, key = rest.rpartition(".")
            state["optimizer"].setdefault(param, {})[key] = slot.local
    for alias, target in manifest.get("aliases", {}).items():
        state["model"][alias.partition(".")[2]] = state["model"][target.partition(".")[2]]
    return state, manifest


def read_newest(store: SnapshotStore) -> tuple[dict, dict] | None:
    """(state, manifest) of the store's newest snapshot that loads, read whole; None when it holds
    no committed snapshot."""
    committed = [s for s in store.list() if s.committed]
    if not committed:
        return None
    manifest, state = newest_that_loads(store, candidates(store, committed, limit=len(committed)),
                                        lambda path, _: read_whole(store, path)[0])
    return state, manifest


def load_from(path: str, storage_options: dict | None = None) -> tuple[dict, dict]:
    """(state, manifest) of a snapshot folder, or of the newest good snapshot of a store."""
    parent, _, name = path.rstrip("/").rpartition("/")
    if STEP_RE.match(name):
        store = SnapshotStore(parent or ".", storage_options)
        return read_whole(store, store._path(name))
    found = read_newest(SnapshotStore(path, storage_options))
    if found is None:
        raise SnapshotError(f"no committed snapshot in {path}")
    return found


def _shares(chunks: list[Chunk], world: int) -> list[list[Chunk]]:
    """The chunks cut into `world` contiguous groups of about the same number of bytes."""
    total, out, acc = sum(c.size for c in chunks), [[] for _ in range(world)], 0
    for c in chunks:
        out[min(world - 1, acc * world // max(total, 1))].append(c)
        acc += c.size
    return out


def _segments(share: list[Chunk], copier: Copier) -> list[tuple[Target, int, int]]:
    """A share's bytes of replicated targets, in order: (target, from, to) within the target."""
    out = []
    for c in share:
        for t in copier.overlapping(c.file, c.start, c.start + c.size):
            lo, hi = max(c.start, t.offset), min(c.start + c.size, t.end)
            out.append((t, lo - t.offset, hi - t.offset))
    return out


def _exchange(replicated: Copier, shares: list[list[Chunk]], rank: int, world: int, limit: int) -> None:
    """Every rank's share into every other rank's tensors: rounds of one all-gather, each rank
    adding `limit // world` bytes of its share (read from its own tensors) to a flat buffer."""
    streams = [_segments(s, replicated) for s in shares]
    lengths = [sum(hi - lo for _, lo, hi in s) for s in streams]
    device = next((ts[0].dest.device for ts in replicated.by_file.values()), torch.device("cpu"))
    unit = max(1, min(limit // world, max(lengths)))
    out = torch.empty(unit * world, dtype=torch.uint8, device=device)
    parts = list(out.split(unit))
    for pos in range(0, max(lengths), unit):
        _move(streams[rank], pos, parts[rank], into_buffer=True)
        dist.all_gather(parts, parts[rank].clone())
        for r in range(world):
            if r != rank:
                _move(streams[r], pos, parts[r], into_buffer=False)


def _move(stream: list[tuple[Target, int, int]], pos: int, buf: torch.Tensor, into_buffer: bool) -> None:
    """Bytes [pos, pos + len(buf)) of a share's stream between its targets and `buf`."""
    at = 0  # the stream position of the segment's first byte
    for t, lo, hi in stream:
        n = hi - lo
        a, b = max(pos, at), min(pos + buf.numel(), at + n)
        if a < b:
            src = t.dest[lo + a - at:lo + b - at]
            if into_buffer:
                buf[a - pos:b - pos].copy_(src)
            else:
                src.copy_(buf[a - pos:b - pos])
        at += n
        if at >= pos + buf.numel():
            break


def _agree(errors: list[str], path: str, world: int, device: torch.device) -> None:
    """Raise on every rank if any rank met a problem (each problem named once): one all-reduce, and
    only when there are some, the messages (JSON strings, through all_gather_object). DamagedError,
    or TransientError if any read failed in a way that may pass: the snapshot may be good."""
    if world > 1:
        flag = torch.tensor([float(len(errors))], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(flag)
        if flag.item() > 0:
            everyone = [None] * world
            dist.all_gather_object(everyone, json.dumps(errors))
            errors = sorted({e for errs in everyone for e in json.loads(errs)})
    if errors:
        what = "; ".join(errors[:5]) + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")
        if any(TRANSIENT in e for e in errors):
            raise TransientError(f"snapshot {path} could not be read now: {what}; exiting so that torchrun tries the "
                                 "start again rather than resume an older snapshot")
        raise DamagedError(f"snapshot {path} is damaged: {what}")
