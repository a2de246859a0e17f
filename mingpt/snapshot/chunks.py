"""A snapshot's bytes into tensors, checked chunk by chunk.

The manifest (format 3) gives each shard file's size and the sha256 of each of its fixed-size chunks
(CHUNK_BYTES; the last one shorter); where each tensor's rows lie in the files is not recorded: it is
`layout.cut` of the tensors' names, shapes and dtypes and the number of writers. So the manifest
grows with the bytes and the number of files, not with tensors x writers. A reader reads whole
chunks (from the node cache when it holds them), checks each, and copies the bytes it needs into
its tensors. (Formats 1 and 2 and the fused `c_attn` of the project's first week are refused in
one line by store.read_manifest.)

A `Target` is a byte range of one shard file and the uint8 view of the tensor rows it fills.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mingpt.snapshot.layout import EXTRA_FILE, SHARD_FORMAT, Piece, Slot, as_rows, cut, dtype_of
from mingpt.snapshot.transport import Files, join, pread_into

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20
BATCH_BYTES = 256 * 2**20  # the host buffer chunks are read through, a batch at a time


def sha256(view) -> str:
    return hashlib.sha256(view).hexdigest()


@dataclass(frozen=True)
class Chunk:
    file: str  # shard file name
    start: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Target:
    file: str
    offset: int  # in the file
    dest: torch.Tensor  # flat uint8 view of the rows this range fills
    replicated: bool = False  # every rank holds these rows (DDP, one process)

    @property
    def end(self) -> int:
        return self.offset + self.dest.numel()


def layout_of(manifest: dict) -> dict[str, list[Piece]]:
    """{tensor name: its pieces}, recomputed from the tensors: `layout.cut`, as the writers cut them
    (a pipeline's snapshot: each tensor among its stage's writers)."""
    tensors = manifest["tensors"]
    specs = [(name, tuple(e["shape"]), dtype_of(e["dtype"])) for name, e in tensors.items()]
    stage_of = {name: e["stage"] for name, e in tensors.items() if "stage" in e}
    copies = manifest.get("copies", manifest.get("replicas", 1))  # "replicas": HSDP's copies before they were named so
    return cut(specs, manifest["writers"], copies, manifest.get("stages", 1), stage_of)[0]


def row_bytes(entry: dict) -> int:
    return math.prod(entry["shape"][1:]) * torch.empty((), dtype=dtype_of(entry["dtype"])).element_size()


def chunks_of(manifest: dict) -> list[Chunk]:
    """Every checksummed byte range of the shard files, in file order."""
    size = manifest["chunk_bytes"]
    return [Chunk(name, i * size, min(size, f["size"] - i * size), digest)
            for name, f in sorted(manifest["files"].items()) if name != EXTRA_FILE
            for i, digest in enumerate(f["sha256"])]


def targets_of(manifest: dict, slots: list[Slot]) -> list[Target]:
    """The byte ranges of the shard files that fill each slot's rows, sorted by file and offset."""
    layout, writers, out = layout_of(manifest), manifest["writers"], []
    for slot in slots:
        rows, per_row = as_rows(slot.local), row_bytes(manifest["tensors"][slot.name])
        for p in layout[slot.name]:
            start, stop = max(p.start, slot.start), min(p.stop, slot.stop)
            if start < stop and per_row:
                out.append(Target(SHARD_FORMAT.format(p.writer, writers), p.offset + (start - p.start) * per_row,
                                  rows[start - slot.start:stop - slot.start].reshape(-1), not slot.sharded))
    return sorted(out, key=lambda t: (t.file, t.offset))


class Copier:
    """Copies a file's bytes into the targets they belong to (and, for the exchange, back out)."""

    def __init__(self, targets: list[Target]):
        self.by_file: dict[str, list[Target]] = {}
        for t in targets:
            self.by_file.setdefault(t.file, []).append(t)
        self.starts = {f: [t.offset for t in ts] for f, ts in self.by_file.items()}

    def overlapping(self, file: str, start: int, end: int) -> list[Target]:
        ts = self.by_file.get(file, [])
        i = max(bisect.bisect_right(self.starts.get(file, []), start) - 1, 0)
        out = []
        while i < len(ts) and ts[i].offset < end:
            if ts[i].end > start:
                out.append(ts[i])
            i += 1
        return out

    def put(self, file: str, start: int, data: torch.Tensor) -> None:
        """Bytes [start, start + len(data)) of `file` into every target they overlap."""
        for t in self.overlapping(file, start, start + data.numel()):
            lo, hi = max(start, t.offset), min(start + data.numel(), t.end)
            t.dest[lo - t.offset:hi - t.offset].copy_(data[lo - start:hi - start], non_blocking=True)


def needed(chunks: list[Chunk], copier: Copier) -> list[Chunk]:
    """The chunks that hold bytes of any target."""
    return [c for c in chunks if copier.overlapping(c.file, c.start, c.start + c.size)]


def read_chunks(files: Files, path: str, chunks: list[Chunk], copier: Copier, cache=None, step: int | None = None,
                sizes: dict | None = None, batch_bytes: int = BATCH_BYTES) -> list[str]:
    """Read `chunks` of snapshot `path` through one host buffer (a batch at a time), check each
    against its sha256 and copy it into the targets; one message per damaged or unreadable chunk.
    `sizes` (each file's size) serve the node `cache`, whose copies are checked as they are read."""
    if not chunks:
        return []
    pinned = torch.cuda.is_available() and any(t.dest.is_cuda for ts in copier.by_file.values() for t in ts)
    buf = host_buffer(min(max(batch_bytes, max(c.size for c in chunks)), sum(c.size for c in chunks)), pinned)
    errors, i, from_cache = [], 0, 0
    while i < len(chunks):
        batch, used = [], 0
        while i < len(chunks) and (not batch or used + chunks[i].size <= buf.numel()):
            batch.append((chunks[i], used))
            used, i = used + chunks[i].size, i + 1
        views = [memoryview(buf[o:o + c.size].numpy()) for c, o in batch]
        todo = list(range(len(batch)))
        if cache is not None and cache.enabled:
            todo = [k for k in todo if not _from_cache(cache, step, sizes, batch[k][0], views[k])]
            from_cache += len(batch) - len(todo)
        failed = files.fill([(join(path, batch[k][0].file), batch[k][0].start, views[k]) for k in todo])
        failed = {todo[k]: msg for k, msg in failed.items()}

        def check(k: int) -> str | None:  # the chunks from the store (the cache's were checked)
            c = batch[k][0]
            if k in failed:
                return failed[k]
            if sha256(views[k]) != c.sha256:
                return f"shard {c.file} fails its checksum (bytes {c.start}-{c.start + c.size})"
            return None

        problems = [None] * len(batch)
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshot-check") as pool:
            for k, problem in zip(todo, pool.map(check, todo)):
                problems[k] = problem
        for (c, o), problem in zip(batch, problems):
            if problem:
                errors.append(problem)
            else:
                copier.put(c.file, c.start, buf[o:o + c.size])
        if pinned:
            torch.cuda.synchronize()  # the copies out of the buffer are done before it is refilled
    if from_cache:
        log.info("node cache: %d of %d chunks read from %s", from_cache, len(chunks), cache.dir)
    return sorted(set(errors))


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _from_cache(cache, step: int, sizes: dict, chunk: Chunk, view: memoryview) -> bool:
    """Fill `view` with the chunk from this node's copy, checked; False when it is missing or damaged."""
    file = cache.file(step, chunk.file, sizes[chunk.file])
    if file is None:
        return False
    try:
        pread_into(file, chunk.start, view)
    except OSError:
        return False
    return sha256(view) == chunk.sha256


def whole_slots(manifest: dict) -> list[Slot]:
    """Whole tensors of every entry of the manifest, to be filled (one process reads everything)."""
    return [Slot(name, torch.empty(e["shape"], dtype=dtype_of(e["dtype"])), tuple(e["shape"]))
            for name, e in manifest["tensors"].items()]
