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


def load_from(path: str, storage_options: dict | None = None) -> tuple[dict, dict]:
    """(state, manifest) of a snapshot folder, or of the newest good snapshot of a store."""
    parent, _, name = path.rstrip("/").rpartition("/")
    if _STEP_RE.match(name):
        store = SnapshotStore(parent or ".", storage_options)
        return store.load(store._path(name))
    found = SnapshotStore(path, storage_options).load_latest()
    if found is None:
        raise SnapshotError(f"no committed snapshot in {path}")
    return found
