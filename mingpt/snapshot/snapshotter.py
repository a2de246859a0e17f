"""Asynchronous, retried saving for the job's single writer: training blocks only for the copy into
reused CPU buffers; serialization, upload, retries and retention run on a background thread."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mingpt.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)


def cpu_copy(obj, into=None):
    """A copy of a state tree with every tensor copied off the accelerator into CPU memory.

    This is the only part of a save that blocks training: afterwards the live tensors may change.
    `into`, a previous copy of the same structure, is reused where shapes match: writing into
    memory that is already mapped (and pinned) is several times faster than allocating anew.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not (isinstance(into, torch.Tensor) and into.shape == t.shape and into.dtype == t.dtype):
            into = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        return into.copy_(t, non_blocking=t.device.type == "cuda")
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return {k: cpu_copy(v, prev.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(cpu_copy(v, p) for v, p in zip(obj, prev))
    return obj


class Snapshotter:
    """Asynchronous, retried snapshot saving for the job's single writer.

    `save` blocks only while the state is copied to CPU; serialization, upload, retries and
    retention run on one background thread, one snapshot at a time. A failed save is logged
    and training goes on: the previous snapshot stays the latest committed one.
    """

    def __init__(self, store: SnapshotStore, keep_last: int, keep_every: int = 0, retries: int = 3,
                 backoff_s: float = 1.0, enabled: bool = True):
        self.store, self.keep_last, self.keep_every = store, keep_last, keep_every
        self.retries, self.backoff_s, self.enabled = retries, backoff_s, enabled
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot") if enabled else None
        self._pending: Future | None = None
        self.last_saved_step: int | None = None
        self._requested_step: int | None = None
        self._buffers = None  # the last CPU copy, reused by the next save once it has been written
        self.failures = 0
        self.blocking_s: list[float] = []

    def save(self, step: int, state: dict, manifest: dict) -> None:
        if not self.enabled or step == self._requested_step:  # e.g. the final save right after a periodic one
            return
        self._requested_step = step
        self.wait()  # one save at a time; usually long finished
        t0 = time.perf_counter()
        state = self._buffers = cpu_copy(state, self._buffers)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        self.blocking_s.append(time.perf_counter() - t0)
        self._pending = self._pool.submit(self._write, step, state, manifest, t0)

    def _write(self, step: int, state: dict, manifest: dict, t0: float) -> None:
        for attempt in range(self.retries + 1):
            try:
                path = self.store.save(step, state, manifest)
                pruned = self.store.prune(self.keep_last, self.keep_every, protect=step)
                self.last_saved_step = step
                log.info("snapshot step %d committed to %s in %.2fs (%.0f ms blocking)%s", step, path,
                         time.perf_counter() - t0, 1000 * self.blocking_s[-1],
                         f", pruned {len(pruned)}" if pruned else "")
                return
            except Exception as e:  # noqa: BLE001 - storage errors of any backend: retry, then report
                if attempt == self.retries:
                    self.failures += 1
                    log.error("snapshot step %d failed after %d attempts (%s: %s); training goes on and the "
                              "previous snapshot stays the latest", step, attempt + 1, e.__class__.__name__, e)
                    return
                delay = self.backoff_s * 2**attempt
                log.warning("snapshot step %d: attempt %d failed (%s: %s); retrying in %.1fs", step, attempt + 1,
                            e.__class__.__name__, e, delay)
                time.sleep(delay)

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed or failed."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        if self._pool is not None:
            self.wait()
            self._pool.shutdown()
            self._pool = None
