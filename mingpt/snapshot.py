"""Snapshots through fsspec (a local directory or s3://): save, find, load, prune.

Layout of a store:

    <store>/step_000000500/state.pt        the training state (tensors and plain containers)
    <store>/step_000000500/manifest.json   written last: its presence commits the snapshot

A snapshot is found by scanning for step folders that hold a manifest; anything else
(an interrupted write, a temporary folder) is invisible. Local writes go to a temporary
folder that is fsynced and renamed into place; object stores rely on atomic single-object PUT.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{9})$")


class SnapshotError(RuntimeError):
    """A snapshot cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: str
    committed: bool


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through."""

    def __init__(self, fh):
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self.fh.write(b)

    def flush(self) -> None:
        self.fh.flush()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotStore:
    """All snapshot I/O of a run goes through this one fsspec-backed object."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:09d}"

    def check(self) -> None:
        """Raise if the store cannot be reached (e.g. the bucket is missing or the endpoint down)."""
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        else:
            self.fs.info(self.root.split("/", 1)[0])  # the bucket itself
        self.list()

    def list(self) -> list[SnapshotInfo]:
        """Every step folder in the store, oldest first, with whether it is committed."""
        self.fs.invalidate_cache()  # another process (the writer) may have changed the store
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True) if self.fs.exists(self.root) else []
        except FileNotFoundError:
            entries = []
        out = []
        for entry in entries:
            m = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m:
                committed = self.fs.exists(f"{entry.rstrip('/')}/{MANIFEST_FILE}")
                out.append(SnapshotInfo(int(m.group(1)), entry.rstrip("/"), committed))
        return sorted(out, key=lambda s: s.step)

    def save(self, step: int, state: dict, manifest: dict) -> str:
        """Write and commit the snapshot of `step`; returns its path."""
        final = self._path(self.name(step))
        if self.local:
            # Build everything under a temporary name, then one rename makes it appear whole.
            work = self._path(f".tmp-{self.name(step)}-{uuid.uuid4().hex[:8]}")
        else:
            work = final
        self.fs.makedirs(work, exist_ok=True)
        with self.fs.open(f"{work}/{STATE_FILE}", "wb") as fh:
            w = _HashingWriter(fh)
            torch.save(state, w)
            w.flush()
            if self.local:
                os.fsync(fh.fileno())
        manifest = {
            **manifest,
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "files": {STATE_FILE: {"size": w.size, "sha256": w.sha.hexdigest()}},
            "versions": {"torch": torch.__version__},
        }
        with self.fs.open(f"{work}/{MANIFEST_FILE}", "wb") as fh:  # written last: the commit
            fh.write(json.dumps(manifest, indent=1, default=str).encode())
            if self.local:
                fh.flush()
                os.fsync(fh.fileno())
        if self.local:
            if self.fs.exists(final):  # a stale uncommitted folder of the same step
                self.fs.rm(final, recursive=True)
            os.replace(work, final)
            _fsync_dir(self.root)
        return final

    def read_manifest(self, path: str) -> dict:
        with self.fs.open(f"{path}/{MANIFEST_FILE}", "rb") as fh:
            manifest = json.loads(fh.read())
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise SnapshotError(f"snapshot {path} has format version {version}; this mingpt reads {FORMAT_VERSION}")
        return manifest

    def load(self, path: str) -> tuple[dict, dict]:
        """(state, manifest) of one committed snapshot, checksum verified."""
        manifest = self.read_manifest(path)
        with self.fs.open(f"{path}/{STATE_FILE}", "rb") as fh:
            data = fh.read()
        expected = manifest["files"][STATE_FILE]
        if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise SnapshotError(f"snapshot {path}: {STATE_FILE} does not match its manifest checksum "
                                f"({len(data)} bytes, expected {expected['size']})")
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return state, manifest

    def load_latest(self) -> tuple[dict, dict] | None:
        """The newest snapshot that loads, falling back past broken ones with a warning.

        None when the store holds no committed snapshot. Raises when snapshots exist but none
        loads: starting over silently would overwrite a job's history.
        """
        committed = [s for s in self.list() if s.committed]
        errors = []
        for info in reversed(committed):
            try:
                return self.load(info.path)
            except Exception as e:  # noqa: BLE001 - any unreadable snapshot: try the previous one
                log.warning("snapshot %s cannot be loaded (%s: %s); falling back to the previous one",
                            info.path, e.__class__.__name__, e)
                errors.append(f"{info.path}: {e}")
        if committed:
            raise SnapshotError(
                f"no snapshot in {self.url} can be loaded ({'; '.join(errors)}). Pick one that loads with "
                "snapshot.resume=PATH, or start over with snapshot.resume=never snapshot.move_aside=true "
                "(which moves these snapshots aside, deleting nothing)"
            )
        return None

    def run_id_of(self, info: SnapshotInfo) -> str | None:
        """The run a committed snapshot belongs to (None for snapshots older than run ids)."""
        try:
            return self.read_manifest(info.path).get("run_id")
        except Exception:  # noqa: BLE001 - an unreadable manifest belongs to no known run
            return None

    def move_aside(self, snaps: list[SnapshotInfo], stamp: str) -> str:
        """Move step folders into the sibling folder `<store>.aside-<stamp>`; returns its URL.

        Nothing is deleted: a run that starts over keeps the earlier run's snapshots next to it.
        """
        dest = f"{self.root}.aside-{stamp}"
        for info in snaps:
            target = f"{dest}/{info.path.rstrip('/').rsplit('/', 1)[-1]}"
            if self.local:
                self.fs.makedirs(dest, exist_ok=True)
                os.replace(info.path, target)
            else:  # an object store has no rename: server-side copies, then deletes
                self.fs.copy(info.path, target, recursive=True)
                self.fs.rm(info.path, recursive=True)
        return f"{self.url}.aside-{stamp}"

    def prune(self, keep_last: int, keep_every: int = 0, protect: int | None = None) -> list[str]:
        """Delete committed snapshots beyond the newest keep_last (except every keep_every-th
        step, kept forever, and the step `protect`: the newest of the current run, whatever else
        the store holds), and uncommitted leftovers older than the kept ones."""
        snaps = self.list()
        committed = [s for s in snaps if s.committed]
        if len(committed) <= keep_last:
            return []
        oldest_kept = committed[-keep_last].step
        doomed = [s.path for s in snaps
                  if s.step < oldest_kept and s.step != protect
                  and not (s.committed and keep_every and s.step % keep_every == 0)]
        for path in doomed:
            self.fs.rm(path, recursive=True)
        return doomed


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


# ---------------------------------------------------------------- command line
def weights_digest(model_state: dict) -> str:
    """A short sha256 over the model tensors' names, shapes and bytes: equal digests, equal weights."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        t = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _describe(store: SnapshotStore, info: SnapshotInfo, verify: bool) -> dict:
    row = {"step": info.step, "path": info.path, "committed": info.committed}
    if not info.committed:
        return row
    try:
        m = store.read_manifest(info.path)
        row.update(time=m["time"], size=m["files"][STATE_FILE]["size"], world_size=m.get("world_size"),
                   tokens_seen=m.get("tokens_seen"))
    except Exception as e:  # noqa: BLE001 - reported in the table
        row["error"] = f"{e.__class__.__name__}: {e}"
        return row
    if verify:
        try:
            state, _ = store.load(info.path)
            row["checksum"] = "ok"
            row["weights"] = weights_digest(state["model"]) if "model" in state else None
        except Exception as e:  # noqa: BLE001
            row["checksum"] = f"FAILED ({e})"
    return row


def cli(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m mingpt.snapshot", description="Inspect a snapshot store.")
    ap.add_argument("command", choices=["list", "show", "verify"],
                    help="list: one row per snapshot; show: one manifest (newest by default); "
                         "verify: checksums and weights digests")
    ap.add_argument("store", help="local directory or s3://bucket/prefix")
    ap.add_argument("--step", type=int, default=None, help="with show: which step")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    store = SnapshotStore(args.store, {"endpoint_url": args.endpoint_url} if args.endpoint_url else None)
    snaps = store.list()
    if args.command == "show":
        committed = [s for s in snaps if s.committed and (args.step is None or s.step == args.step)]
        if not committed:
            print(f"no committed snapshot{'' if args.step is None else f' at step {args.step}'} in {args.store}",
                  file=sys.stderr)
            return 1
        print(json.dumps(store.read_manifest(committed[-1].path), indent=1))
        return 0
    rows = [_describe(store, s, verify=args.command == "verify") for s in snaps]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'step':>10}  {'state':<11} {'size MB':>9} {'world':>5}  {'saved at':<19}  check")
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if "time" in r else "-"
            state = "committed" if r["committed"] else "incomplete"
            size = f"{r['size'] / 1e6:9.2f}" if "size" in r else f"{'-':>9}"
            check = r.get("error") or r.get("checksum", "")
            if r.get("weights"):
                check += f"  weights {r['weights']}"
            print(f"{r['step']:>10}  {state:<11} {size} {r.get('world_size') or '-':>5}  {when:<19}  {check}")
    bad = any(r.get("error") or str(r.get("checksum", "ok")) != "ok" for r in rows if r["committed"])
    return 1 if (args.command == "verify" and bad) else 0


if __name__ == "__main__":
    raise SystemExit(cli())
