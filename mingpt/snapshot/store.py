"""The snapshot catalogue: write, commit, find, read, prune (the layout: docs/snapshots.md).

A snapshot is committed by its manifest, written last, and found by scanning for step folders that
hold one: an interrupted write is invisible. Format 2 snapshots still load (users may hold them).
The bytes move through transport.py (a local directory or an S3 bucket).
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mingpt.runtime.storage import is_local
from mingpt.snapshot.chunks import sha256
from mingpt.snapshot.layout import EXTRA_FILE
from mingpt.snapshot.s3 import S3Objects
from mingpt.snapshot.transport import Files, LocalFiles, damaged, join, retried

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
PIPELINE_VERSION = 4  # a pipeline's snapshot: each tensor cut among its stage's writers (layout.cut); an
# older mingpt refuses it by its version rather than read its rows from the wrong files
READABLE_VERSIONS = (FORMAT_VERSION, PIPELINE_VERSION)
MANIFEST_FILE = "manifest.json"
REJECTED_FILE = "rejected.txt"
STEP_RE = re.compile(r"^step_(\d{9})$")


class SnapshotError(RuntimeError):
    """A snapshot cannot be used; the message says why and what to do."""


class MismatchError(SnapshotError):
    """The snapshot is of another model shape or tokenizer: no older one of the store would fit."""


class DamagedError(SnapshotError):
    """The snapshot's bytes are bad (a checksum, a short or missing file): no later load will succeed."""


class TransientError(OSError):
    """The store could not be read now, after retries (a timeout, a dropped connection): nothing is
    known to be wrong with the snapshots nor the settings, so the process exits with 1 and torchrun
    tries the start again, rather than resuming from an older snapshot."""


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: str
    committed: bool


def nothing_loads(url: str, why: str) -> SnapshotError:
    """The error of a store whose snapshots all fail to load: starting over would lose a job's history."""
    return SnapshotError(f"no snapshot in {url} can be loaded ({why}). Pick one that loads with snapshot.resume=PATH, "
                         "or start over with snapshot.resume=never snapshot.move_aside=true (which moves these "
                         "snapshots aside, deleting nothing)")


def open_files(url: str, options: dict | None = None, uploader: str = "s3fs", concurrency: int = 8) -> Files:
    """The transport for a local path (or file://) or an s3:// URL (`options`: s3fs's, e.g. endpoint_url)."""
    if is_local(url):
        return LocalFiles(url)
    if url.startswith("s3://"):
        return S3Objects(url, options or {}, uploader, concurrency)
    raise SnapshotError(f"{url}: snapshots go to a local directory or s3://bucket/prefix")


class SnapshotStore:
    """The snapshots of one store (a local directory or s3://bucket/prefix): what exists, what is
    committed, what to read, what to prune. Bytes move through `self.files` (transport.py).

    `storage_options` go to s3fs (endpoint_url, ...); `uploader` picks how a large file goes to an
    object store: "s3fs" (its multipart upload, `concurrency` parts in flight) or "boto3"."""

    def __init__(self, url: str, storage_options: dict | None = None, uploader: str = "s3fs",
                 concurrency: int = 8):
        self.url = url.rstrip("/")
        self.storage_options, self.uploader = dict(storage_options or {}), uploader
        self.files = open_files(self.url, self.storage_options, uploader, concurrency)
        self.root, self.local = self.files.root, self.files.local

    def other(self, url: str) -> SnapshotStore:
        """The store at `url`, reached the way this one is."""
        return self if url.rstrip("/") == self.url else SnapshotStore(url, self.storage_options, self.uploader)

    def _path(self, *parts: str) -> str:
        return join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """A path of this store as its user names it, for messages (s3://bucket/..., not bucket/...)."""
        return self.url + path[len(self.root):]

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:09d}"

    def check(self) -> None:
        """Raise if this process cannot use the store: the bucket is missing, the endpoint is down, or
        it may list but not write (a probe file is written with the configured uploader and deleted)."""
        self.files.check()
        self.list()
        probe = self._path(f".mingpt-probe-{uuid.uuid4().hex}")
        self.files.put(probe, b"mingpt write probe")
        self.files.remove(probe)

    def list(self) -> list[SnapshotInfo]:
        """Every step folder in the store, oldest first, with whether it is committed."""
        out = []
        for name in self.files.names(self.root):
            m = STEP_RE.match(name)
            if m:
                path = self._path(name)
                out.append(SnapshotInfo(int(m.group(1)), path, self.files.exists(join(path, MANIFEST_FILE))))
        return sorted(out, key=lambda s: s.step)

    # ------------------------------------------------------------------ writing
    def begin(self, step: int) -> None:
        """Make the folder of `step` uncommitted before its files are written again (a step saved
        anew after a fall back past it); the first writer calls it before any writer starts."""
        self.files.remove(self._path(self.name(step), MANIFEST_FILE))
        self.files.remove(self._path(self.name(step), REJECTED_FILE))

    def write_file(self, step: int, name: str, data) -> None:
        """Write one file of a snapshot durably (whole or not at all)."""
        self.files.put(self._path(self.name(step), name), data)

    def commit(self, step: int, manifest: dict) -> str:
        """Write the manifest, last: the snapshot of `step` exists from this moment. Returns its path."""
        folder = self._path(self.name(step))
        version = PIPELINE_VERSION if manifest.get("stages", 1) > 1 else FORMAT_VERSION
        manifest = {**manifest, "format_version": version, "step": step, "time": time.time(),
                    "versions": {"torch": torch.__version__}}
        self.files.put(join(folder, MANIFEST_FILE), json.dumps(manifest, indent=1, default=str).encode())
        self.files.sync_dir(folder)
        return folder

    def uploads(self, older_than_s: float = 0.0) -> list[dict]:
        """Multipart uploads of this store's snapshot files (`<store>/step_N/<file>`) never completed
        nor aborted ([] for a local store); any other key under the same prefix is someone else's."""
        prefix = self.root.partition("/")[2]
        prefix += "/" if prefix else ""

        def ours(key: str) -> bool:
            folder, _, file = key.removeprefix(prefix).partition("/")
            return key.startswith(prefix) and bool(STEP_RE.match(folder)) and bool(file) and "/" not in file
        return [u for u in self.files.uploads(older_than_s) if ours(u["key"])]

    # ------------------------------------------------------------------ reading
    def read_manifest(self, path: str) -> dict:
        manifest = json.loads(retried(lambda: self.files.get(join(path, MANIFEST_FILE))))
        if not isinstance(manifest, dict):
            raise SnapshotError(f"snapshot {self.url_of(path)} has a manifest that is not a JSON object")
        version = manifest.get("format_version")
        if version not in READABLE_VERSIONS:
            raise SnapshotError(f"snapshot {self.url_of(path)} has format version {version}; this mingpt reads "
                                f"{', '.join(map(str, READABLE_VERSIONS))}: continue it with the mingpt that wrote it "
                                "(format 2: before 2026-11-24)")
        fused = next((name for name in manifest["tensors"] if ".attn.c_attn." in name), None)
        if fused:
            raise SnapshotError(f"snapshot {self.url_of(path)} holds attention's fused input projection ({fused}), "
                                "saved before it was split into c_q, c_k, c_v (2026-11-26): continue it with the "
                                "mingpt that wrote it")
        return manifest

    def missing_files(self, path: str, manifest: dict, sizes: dict[str, int] | None = None) -> list[str]:
        """The files a manifest lists that are absent or of another size (one listing, no reads;
        `sizes`: the folder's listing when the caller has it)."""
        sizes = retried(lambda: self.files.sizes(path)) if sizes is None else sizes
        out = []
        for name, f in manifest["files"].items():
            if name not in sizes:
                out.append(f"{name} is missing")
            elif sizes[name] != f["size"]:
                out.append(f"{name} has {sizes[name]} bytes, the manifest says {f['size']}")
        return out

    def problems(self, path: str) -> tuple[dict | None, list[str]]:
        """(manifest, why the snapshot cannot load) from its manifest and one listing, no data read:
        an unreadable manifest, a file missing or of another size, or a load that found it damaged
        (REJECTED_FILE). A transient error is retried, then raised as TransientError: it says
        nothing about the snapshot, and must not make a start fall back past it."""
        try:
            manifest = self.read_manifest(path)
            sizes = retried(lambda: self.files.sizes(path))
            missing = self.missing_files(path, manifest, sizes)
        except Exception as e:
            if damaged(e) or isinstance(e, SnapshotError):
                return None, [f"its manifest cannot be read ({e.__class__.__name__}: {e})"]
            raise TransientError(f"cannot read snapshot {self.url_of(path)} now ({e.__class__.__name__}: {e}); exiting "
                                 "so that torchrun tries the start again rather than resume an older snapshot") from e
        return manifest, missing + ([f"a load found it damaged ({REJECTED_FILE} says why)"] if REJECTED_FILE in sizes else [])

    def reject(self, path: str, why: str) -> None:
        """Mark a committed snapshot that a load found damaged: it no longer counts as one to keep,
        and no start tries it again (saving its step anew clears the mark)."""
        self.files.put(join(path, REJECTED_FILE), why.encode())

    def read_extra(self, path: str, manifest: dict) -> dict:
        """The small state (sampler, counters, GradScaler), checksum verified."""
        data = retried(lambda: self.files.get(join(path, EXTRA_FILE)))
        if sha256(data) != manifest["files"][EXTRA_FILE]["sha256"]:
            raise SnapshotError(f"snapshot {self.url_of(path)}: {EXTRA_FILE} does not match its manifest checksum")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

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
            self.files.move(info.path, join(dest, info.path.rstrip("/").rsplit("/", 1)[-1]))
        return f"{self.url}.aside-{stamp}"

    def prune(self, keep_last: int, keep_every: int = 0, protect: int | None = None) -> list[str]:
        """Delete snapshots older than the newest keep_last that load (except every keep_every-th
        step, kept forever, and the step `protect`: the newest of the current run, whatever else
        the store holds). Whether one loads is its `problems` (manifest and listing, no data): a
        damaged one never counts, and is deleted only once older than the kept ones, as are
        uncommitted leftovers."""
        snaps, good = self.list(), []
        for s in reversed(snaps):
            if len(good) == keep_last:
                break
            if s.committed and not self.problems(s.path)[1]:
                good.append(s)
        if len(good) < keep_last:
            return []
        doomed = [s.path for s in snaps
                  if s.step < good[-1].step and s.step != protect
                  and not (s.committed and keep_every and s.step % keep_every == 0)]
        for path in doomed:
            self.files.remove(path)
        return doomed


def candidates(store: SnapshotStore, infos: list[SnapshotInfo], limit: int = 3) -> list[tuple[str, dict]]:
    """(path, manifest) of the newest committed snapshots whose manifest reads and whose files are
    all there at the listed sizes (one listing each, no data read), and that no load found damaged,
    newest first; each one passed over is named in a warning. A read that fails in a way that may
    pass raises TransientError (after retries): falling back past a good snapshot would lose its steps."""
    out = []
    for info in sorted(infos, key=lambda s: -s.step):
        manifest, missing = store.problems(info.path)
        if missing:
            log.warning("snapshot %s cannot be loaded (%s); falling back to the previous one", store.url_of(info.path),
                        "; ".join(missing))
            continue
        out.append((info.path, manifest))
        if len(out) == limit:
            break
    if infos and not out:
        raise nothing_loads(store.url, "see the warnings above")
    return out


def newest_that_loads(store: SnapshotStore, found: list[tuple[str, dict]], load: Callable[[str, dict], Any],
                      check: Callable[[dict], None] | None = None, reject: bool = False) -> tuple[dict, Any]:
    """The one rule for "the newest snapshot that loads": (manifest, load(path, manifest)) of the first
    of `found` (from `candidates`) that `check` accepts and `load` reads without a SnapshotError,
    warning for each one passed over. A snapshot of another model (MismatchError) ends the search,
    as does any other error (a read that may pass: falling back would lose steps). `reject`: mark
    each damaged one rejected, so that retention no longer counts it as kept (one process does)."""
    errors = []
    for path, manifest in found:
        try:
            if check is not None:
                check(manifest)
            return manifest, load(path, manifest)
        except MismatchError:
            raise
        except SnapshotError as e:
            log.warning("snapshot %s cannot be loaded (%s); falling back to the previous one", store.url_of(path), e)
            errors.append(f"{path}: {e}")
            if reject and isinstance(e, DamagedError):
                try:
                    store.reject(path, str(e))
                except Exception as why:  # noqa: BLE001 - the mark only spares later starts and retention
                    log.warning("could not mark snapshot %s rejected (%s: %s)", path, why.__class__.__name__, why)
    raise nothing_loads(store.url, "; ".join(errors))


def open_store(url: str, endpoint_url: str | None, uploader: str = "s3fs") -> SnapshotStore:
    """The snapshot store, checked to be reachable now rather than at the first save."""
    store = None
    try:
        store = SnapshotStore(url, {"endpoint_url": endpoint_url} if endpoint_url else {}, uploader=uploader)
        store.check()
    except Exception as e:  # noqa: BLE001 - any backend's connection or permission error
        if store is not None and not store.local and isinstance(e, FileNotFoundError):  # the bucket (S3Objects.check)
            raise SnapshotError(f"{e}: create the bucket, or correct snapshot.dir (or snapshot.endpoint_url)") from None
        if store is not None and store.local:
            raise SnapshotError(f"cannot use snapshot store {url} ({e.__class__.__name__}: {e}); point "
                                "snapshot.dir (or trainer.run_dir) at a directory you can write to") from None
        raise SnapshotError(
            f"cannot reach snapshot store {url} ({e.__class__.__name__}: {e}); check snapshot.dir, "
            "snapshot.endpoint_url and the AWS credentials / region in the environment"
        ) from None
    return store
