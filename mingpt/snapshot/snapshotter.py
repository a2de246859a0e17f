"""Asynchronous, retried saving by every rank: training blocks only for the copy of this rank's rows
into one reused CPU buffer; hashing, writing, retries, the commit and retention run on a background
thread."""

from __future__ import annotations

import io
import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from mingpt.snapshot.chunks import CHUNK_BYTES, sha256
from mingpt.snapshot.layout import EXTRA_FILE, SHARD_FORMAT, Slot, as_rows, cut, dtype_name, specs_of
from mingpt.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)


class SaveFailedError(RuntimeError):
    """The snapshot a run stops with (its last, or a preemption's) was not saved; the message says
    what to do. The process exits with Exit.SAVE_FAILED (mingpt.runtime.exits)."""


class ShardWriter:
    """One writer's part of a snapshot: the layout's rows of every tensor for writer `writer`, copied
    into one flat CPU buffer laid out as the shard file (reused from save to save), then hashed and
    written. Writer 0 also writes the small state."""

    def __init__(self, writer: int, writers: int, copies: int = 1, stages: int = 1):
        self.writer, self.writers, self.copies, self.stages = writer, writers, copies, stages
        self._specs, self.pieces, self.sizes = None, {}, []
        self._stage_of: dict[str, int] = {}
        self._image: torch.Tensor | None = None

    def own_pieces(self):
        """(tensor name, piece) of this writer, in file order."""
        return [(name, p) for name, ps in self.pieces.items() for p in ps if p.writer == self.writer]

    def copy(self, slots: list[Slot], extra: dict) -> tuple[torch.Tensor, bytes | None]:
        """The blocking part of a save: this writer's rows into the buffer, the small state serialized."""
        specs = specs_of(slots)
        if specs != self._specs:
            self._specs = specs
            self._stage_of = {s.name: s.stage for s in slots} if self.stages > 1 else {}
            self.pieces, self.sizes = cut(specs, self.writers, self.copies, self.stages, self._stage_of)
        size = self.sizes[self.writer]
        if self._image is None or self._image.numel() != size:
            cuda = any(s.local.device.type == "cuda" for s in slots)
            self._image = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        by_name = {s.name: s for s in slots}
        for name, p in self.own_pieces():
            slot = by_name[name]
            if not slot.start <= p.start < p.stop <= slot.stop:
                raise RuntimeError(f"{name}: this rank holds rows {slot.start}-{slot.stop}, the layout gives it "
                                   f"{p.start}-{p.stop}")
            src = as_rows(slot.local)[p.start - slot.start:p.stop - slot.start]
            dst = self._image[p.offset:p.offset + src.numel()].view(src.shape)
            dst.copy_(src, non_blocking=src.device.type == "cuda")
        extra_bytes = None
        if self.writer == 0:
            buf = io.BytesIO()
            torch.save(extra, buf)
            extra_bytes = buf.getvalue()
        return self._image, extra_bytes

    def write(self, store: SnapshotStore, step: int, image: torch.Tensor, extra: bytes | None) -> dict:
        """Write this writer's files durably; returns what the manifest records of them."""
        view = memoryview(image.numpy()) if image.numel() else memoryview(b"")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-hash") as pool:  # beside the write
            hashing = pool.submit(lambda: [sha256(view[i:i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES)])
            store.write_file(step, SHARD_FORMAT.format(self.writer, self.writers), view)
            hashes = hashing.result()
        record = {"writer": self.writer, "size": len(view), "sha256": hashes}
        if extra is not None:
            store.write_file(step, EXTRA_FILE, extra)
            record["extra"] = {"size": len(extra), "sha256": sha256(extra)}
        return record

    def manifest(self, meta: dict, records: list[dict]) -> dict:
        """The manifest of a snapshot from every writer's record (run by the committing writer): the
        tensors (where their rows lie follows from them and the number of writers: layout.cut) and
        each file's size and chunk checksums. Its size does not grow with tensors x writers."""
        tensors = {name: {"dtype": dtype_name(dtype), "shape": list(shape)} for name, shape, dtype in self._specs}
        for name, stage in self._stage_of.items():  # a pipeline: which stage's writers hold it
            tensors[name]["stage"] = stage
        files = {SHARD_FORMAT.format(r["writer"], self.writers): {"size": r["size"], "sha256": r["sha256"]}
                 for r in records}
        files.update((EXTRA_FILE, r["extra"]) for r in records if "extra" in r)  # writer 0's
        # "replicas": the copies' old name, still written for a mingpt before the rename, which would
        # otherwise read an HSDP snapshot's rows as one copy's (chunks.layout_of reads either)
        return {**meta, "writers": self.writers, "copies": self.copies, "replicas": self.copies, "chunk_bytes": CHUNK_BYTES,
                "files": files, "tensors": tensors, **({"stages": self.stages} if self.stages > 1 else {})}

    def record_bytes(self) -> int:
        """An upper bound of the JSON of any writer's record (every writer computes the same)."""
        return 512 + 70 * math.ceil(max(self.sizes, default=0) / CHUNK_BYTES)


class Snapshotter:
    """Asynchronous, retried snapshot saving, one instance per rank (writer); docs/snapshots.md.

    The writers' records go to writer 0 in one gather on `group` (gloo, of their own: it never races
    the training loop's collectives), which commits only when every shard is durable. A failed save
    leaves the previous snapshot the latest; whether training goes on is the caller's decision.
    """

    def __init__(self, store: SnapshotStore, *, writer: int = 0, writers: int = 1, copies: int = 1, stages: int = 1,
                 group=None,
                 keep_last: int = 3, keep_every: int = 0, retries: int = 3, backoff_s: float = 1.0,
                 events: Callable[[dict], None] | None = None, cache=None, guard: Callable[[], bool] | None = None):
        self.store, self.keep_last, self.keep_every = store, keep_last, keep_every
        self.guard = guard  # whether the store is still this job's (its lease: Lease.check), asked just before a commit
        self.retries, self.backoff_s, self.group = retries, backoff_s, group
        self._events = events or (lambda _: None)
        self.cache = cache  # a NodeCache: this node's copy of what this writer wrote
        self._retried_now = 0  # retries of the save in flight, by this writer
        self.shard = ShardWriter(writer, writers, copies, stages)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._pending: Future | None = None
        self.last_ok: bool | None = None  # the outcome of the newest save (None: none yet)
        self._requested_step: int | None = None
        self.failures = 0
        self.blocking_s: list[float] = []

    @property
    def committer(self) -> bool:
        return self.shard.writer == 0

    def save(self, step: int, slots: list[Slot], extra: dict, manifest: dict) -> None:
        """Every rank calls this at the same step; returns once the state may change again."""
        if step == self._requested_step:  # e.g. the final save right after a periodic one
            return
        self._requested_step = step
        self.wait()  # one save at a time; usually long finished
        t0 = time.perf_counter()
        image, extra_bytes = self.shard.copy(slots, extra)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        self.blocking_s.append(time.perf_counter() - t0)
        self._pending = self._pool.submit(self._write, step, image, extra_bytes, manifest, t0)

    def _write(self, step: int, image: torch.Tensor, extra: bytes | None, manifest: dict, t0: float) -> bool:
        """Write this writer's share and, on the committer, commit; whether the save succeeded as far
        as this writer can tell (the committer: committed; the others: every shard written)."""
        self._retried_now = 0
        ready = not self.committer or self._retried(step, "preparing", lambda: self.store.begin(step) or True)
        if not self._from_committer(bool(ready)):  # nobody writes before the folder is uncommitted
            return self._failed(step, t0, "the snapshot folder could not be prepared")
        record = self._retried(step, "writing its shard", lambda: self.shard.write(self.store, step, image, extra))
        if record is not None:
            record["retries"] = self._retried_now
            if self.cache is not None:
                self.cache.put(step, SHARD_FORMAT.format(self.shard.writer, self.shard.writers), image.numpy())
        records = self._gather(record)
        if not self.committer:  # the records went to the committer alone, which reports the outcome
            if record is None:
                return self._failed(step, t0, "its shard could not be written")
            return True
        if any(r is None for r in records):
            bad = [SHARD_FORMAT.format(i, self.shard.writers) for i, r in enumerate(records) if r is None]
            return self._failed(step, t0, f"{', '.join(bad)} could not be written")
        if self.guard is not None and not self.guard():  # another job holds the store now: the guard said so
            return False
        path = self._retried(step, "committing", lambda: self.store.commit(step, self.shard.manifest(manifest, records)))
        if path is None:
            return self._failed(step, t0, "the manifest could not be committed")
        try:
            pruned = self.store.prune(self.keep_last, self.keep_every, protect=step)
        except Exception as e:  # noqa: BLE001 - step is committed whatever became of the older ones
            log.warning("snapshot step %d committed, but pruning older snapshots failed (%s: %s); the next "
                        "save prunes again", step, e.__class__.__name__, e)
            pruned = []
        total = time.perf_counter() - t0
        log.info("snapshot step %d committed to %s by %d writer%s in %.2fs (%.0f ms blocking)%s", step,
                 self.store.url_of(path), self.shard.writers, "" if self.shard.writers == 1 else "s", total,
                 1000 * self.blocking_s[-1], f", pruned {len(pruned)}" if pruned else "")
        self._events({"kind": "snapshot", "step": step, "status": "committed", "total_s": round(total, 4),
                      "blocking_s": round(self.blocking_s[-1], 4), "bytes": sum(r["size"] for r in records),
                      "writers": self.shard.writers, "retries": sum(r["retries"] for r in records)})
        return True

    def _failed(self, step: int, t0: float, why: str) -> bool:
        self.failures += 1
        if self.committer:
            log.error("snapshot step %d not committed: %s; %s", step, why, self.newest())
            self._events({"kind": "snapshot", "step": step, "status": "failed", "reason": why,
                          "total_s": round(time.perf_counter() - t0, 4), "blocking_s": round(self.blocking_s[-1], 4)})
        return False

    def newest(self) -> str:
        """What a restart would start from now, in words: the newest committed snapshot, or none."""
        try:
            steps = [s.step for s in self.store.list() if s.committed]
        except Exception:  # noqa: BLE001 - a store that fails to list: say what is known
            return "the previous snapshot, if any, stays the newest"
        return f"the newest snapshot is still step {max(steps)}" if steps else \
            "no snapshot is committed yet: a restart begins at step 0"

    def _retried(self, step: int, what: str, fn):
        """fn() with retries and backoff; None (logged) when every attempt failed."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - storage errors of any backend: retry, then report
                if attempt == self.retries:
                    log.error("snapshot step %d failed after %d attempts %s (%s: %s)", step, attempt + 1, what,
                              e.__class__.__name__, e)
                    return None
                delay = self.backoff_s * 2**attempt
                self._retried_now += 1
                self._events({"kind": "snapshot", "step": step, "status": "retry", "what": what, "attempt": attempt + 1,
                              "error": f"{e.__class__.__name__}: {e}"[:200]})
                if attempt == 0:  # once per save: the outcome is logged either way
                    log.warning("snapshot step %d: %s failed (%s: %s); retrying up to %d times", step, what,
                                e.__class__.__name__, e, self.retries)
                time.sleep(delay)
        return None

    def _from_committer(self, ok: bool) -> bool:
        """The committer's flag on every writer (one broadcast)."""
        if self.shard.writers == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.uint8)
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def _gather(self, record: dict | None) -> list:
        """Every writer's record on the committer (one gather of fixed-size JSON buffers: O(writers)
        bytes in all, nothing pickled); [] on the other writers."""
        if self.shard.writers == 1:
            return [record]
        size = self.shard.record_bytes()
        data = json.dumps(record).encode()
        if len(data) > size:
            raise RuntimeError(f"a snapshot record of {len(data)} bytes exceeds its bound of {size}")
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(size, dtype=torch.uint8) for _ in range(self.shard.writers)] if self.committer else None
        dist.gather(buf, out, dst=0, group=self.group)
        return [json.loads(bytes(b.numpy()).rstrip(b"\0")) for b in out] if self.committer else []

    def wait(self) -> bool | None:
        """Block until the save in flight (if any) has committed or failed; the outcome of the newest
        save (None when nothing was saved yet). A failed save raises nothing: the caller decides."""
        if self._pending is not None:
            try:
                self.last_ok = bool(self._pending.result())
            except Exception as e:  # noqa: BLE001 - a bug or a broken side group: the save did not happen
                log.error("snapshot step %d failed (%s: %s)", self._requested_step, e.__class__.__name__, e)
                self.last_ok = False
            self._pending = None
        return self.last_ok

    def close(self, wait: bool = True) -> None:
        """Finish (wait=True) or abandon the save in flight: after a peer failure a save can never
        gather every writer's record, so an exiting rank does not wait for it."""
        if self._pool is not None:
            if wait:
                self.wait()
            self._pool.shutdown(wait=wait)
            self._pool = None
