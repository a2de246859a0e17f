"""Snapshots through fsspec (a local directory or s3://): write, commit, find, read, prune.

Layout of a store (format 2):

    <store>/step_000000500/shard-00000-of-00002.bin   writer 0's rows of every tensor (raw bytes)
    <store>/step_000000500/shard-00001-of-00002.bin   writer 1's rows
    <store>/step_000000500/extra.pt                   the small state: sampler, counters, GradScaler
    <store>/step_000000500/manifest.json              written last: its presence commits the snapshot

The manifest lists every tensor's dtype, shape and pieces (writer, offset, rows, sha256) and every
file's size, so a reader takes just the rows it needs and checks them. A snapshot is found by
scanning for step folders that hold a manifest; anything else (an interrupted write, a leftover
file) is invisible. Local files are written under a temporary name, fsynced and renamed; object
stores rely on atomic single-object PUT and multipart completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import torch

from mingpt.snapshot.layout import EXTRA_FILE, SHARD_FORMAT, Piece, as_rows, dtype_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (2,)
MANIFEST_FILE = "manifest.json"
PART_BYTES = 32 * 2**20  # multipart upload part size
_STEP_RE = re.compile(r"^step_(\d{9})$")


class SnapshotError(RuntimeError):
    """A snapshot cannot be used; the message says why and what to do."""


class MismatchError(SnapshotError):
    """The snapshot is of another model shape or tokenizer: no older one of the store would fit."""


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: str
    committed: bool


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(view) -> str:
    return hashlib.sha256(view).hexdigest()


class _ViewReader(io.RawIOBase):
    """A read-only file over a memoryview, for boto3's transfer manager (no copy of the whole)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: len(self.view) + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos


class SnapshotStore:
    """All snapshot I/O of a run goes through this one fsspec-backed object.

    `uploader` picks how a large file goes to an object store: "s3fs" (its multipart upload,
    `concurrency` parts in flight) or "boto3" (boto3's transfer manager, as many threads).
    """

    def __init__(self, url: str, storage_options: dict | None = None, uploader: str = "s3fs",
                 concurrency: int = 8):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.uploader, self.concurrency = uploader, concurrency
        self._boto = None

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:09d}"

    def check(self) -> None:
        """Raise if this process cannot use the store: the bucket is missing, the endpoint is down, or
        it may list but not write (a probe file is written with the configured uploader and deleted)."""
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        else:
            self.fs.info(self.root.split("/", 1)[0])  # the bucket itself
        self.list()
        probe = self._path(f".mingpt-probe-{uuid.uuid4().hex}")
        self.put(probe, b"mingpt write probe")
        self.fs.rm(probe)

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

    # ------------------------------------------------------------------ writing
    def begin(self, step: int) -> None:
        """Make the folder of `step` uncommitted before its files are written again (a step saved
        anew after a fall back past it); the first writer calls it before any writer starts."""
        path = self._path(self.name(step), MANIFEST_FILE)
        if self.fs.exists(path):
            self.fs.rm(path)
        if self.local:
            self.fs.makedirs(self._path(self.name(step)), exist_ok=True)

    def write_file(self, step: int, name: str, data) -> None:
        """Write one file of a snapshot durably (local: fsynced under a temporary name, then renamed;
        object store: a PUT, or a multipart upload with several parts in flight)."""
        self.put(self._path(self.name(step), name), data)

    def put(self, path: str, data) -> None:
        """Write one file of the store durably, through the configured uploader."""
        view = memoryview(data).cast("B")
        if self.local:
            folder, name = path.rsplit("/", 1)
            os.makedirs(folder, exist_ok=True)
            tmp = f"{folder}/.{name}.{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as fh:
                    fh.write(view)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        elif self.uploader == "boto3":
            self._upload_boto3(path, view)
        else:
            self._upload_s3fs(path, view)

    def _upload_s3fs(self, path: str, view: memoryview) -> None:
        if len(view) < 2 * PART_BYTES:
            self.fs.pipe_file(path, bytes(view))
            return
        fs = self.fs
        bucket, key, _ = fs.split_path(path)

        async def upload() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            gate = asyncio.Semaphore(self.concurrency)

            async def part(i: int, start: int) -> dict:
                async with gate:
                    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                            PartNumber=i + 1, Body=bytes(view[start:start + PART_BYTES]))
                return {"PartNumber": i + 1, "ETag": out["ETag"]}

            # Every part ends (uploaded or failed) before an abort: a part still in flight when the
            # upload is aborted may be stored after it, and would be billed as an orphan.
            results = await asyncio.gather(*(part(i, s) for i, s in enumerate(range(0, len(view), PART_BYTES))),
                                           return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            try:
                if failed is not None:
                    raise failed
                await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                  MultipartUpload={"Parts": list(results)})
            except BaseException:
                await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"])
                raise

        fsspec.asyn.sync(fs.loop, upload)
        fs.invalidate_cache(path)

    def uploads(self, older_than_s: float = 0.0) -> list[dict]:
        """Multipart uploads under this store begun more than `older_than_s` ago and never completed
        nor aborted (a process that died mid-upload leaves one: its parts are stored, and billed,
        until it is aborted). [] for a local store."""
        if self.local:
            return []
        bucket, _, prefix = self.root.partition("/")
        out, marker = [], {}
        while True:
            page = fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "list_multipart_uploads", Bucket=bucket,
                                    Prefix=prefix + "/" if prefix else "", **marker)
            for u in page.get("Uploads", []):
                age = time.time() - u["Initiated"].timestamp()
                if age >= older_than_s:
                    out.append({"bucket": bucket, "key": u["Key"], "upload_id": u["UploadId"], "age_s": age})
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, upload: dict) -> None:
        fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=upload["bucket"],
                         Key=upload["key"], UploadId=upload["upload_id"])

    def _upload_boto3(self, path: str, view: memoryview) -> None:
        """boto3's transfer manager: the s3transfer package over a plain botocore client (boto3 itself
        would pin botocore to a release that s3fs's aiobotocore may not accept)."""
        import botocore.session
        from s3transfer.manager import TransferConfig, TransferManager

        if self._boto is None:
            opts = self.storage_options
            self._boto = botocore.session.get_session().create_client(
                "s3", endpoint_url=opts.get("endpoint_url") or opts.get("client_kwargs", {}).get("endpoint_url"))
        bucket, key = path.split("/", 1)
        config = TransferConfig(multipart_threshold=2 * PART_BYTES, multipart_chunksize=PART_BYTES,
                                max_request_concurrency=self.concurrency)
        with TransferManager(self._boto, config) as manager:
            manager.upload(_ViewReader(view), bucket, key).result()
        self.fs.invalidate_cache(path)

    def commit(self, step: int, manifest: dict) -> str:
        """Write the manifest, last: the snapshot of `step` exists from this moment. Returns its path."""
        folder = self._path(self.name(step))
        manifest = {**manifest, "format_version": FORMAT_VERSION, "step": step, "time": time.time(),
                    "versions": {"torch": torch.__version__}}
        data = json.dumps(manifest, indent=1, default=str).encode()
        if self.local:
            self.write_file(step, MANIFEST_FILE, data)
            _fsync_dir(folder)
        else:
            self.fs.pipe_file(f"{folder}/{MANIFEST_FILE}", data)
        return folder

    # ------------------------------------------------------------------ reading
    def read_manifest(self, path: str) -> dict:
        with self.fs.open(f"{path}/{MANIFEST_FILE}", "rb") as fh:
            manifest = json.loads(fh.read())
        version = manifest.get("format_version")
        if version not in READABLE_VERSIONS:
            raise SnapshotError(f"snapshot {path} has format version {version}; this mingpt reads "
                                f"{', '.join(map(str, READABLE_VERSIONS))}: use the mingpt that wrote it")
        return manifest

    def missing_files(self, path: str, manifest: dict) -> list[str]:
        """The files a manifest lists that are absent or of another size (one listing, no reads)."""
        sizes = {e["name"].rsplit("/", 1)[-1]: e["size"] for e in self.fs.ls(path, detail=True, refresh=True)}
        out = []
        for name, f in manifest["files"].items():
            if name not in sizes:
                out.append(f"{name} is missing")
            elif sizes[name] != f["size"]:
                out.append(f"{name} has {sizes[name]} bytes, the manifest says {f['size']}")
        return out

    def read_into(self, path: str, name: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of local file `name` of snapshot `path` from `offset` on."""
        pread_into(f"{path}/{name}", offset, out)

    def read_extra(self, path: str, manifest: dict) -> dict:
        """The small state (sampler, counters, GradScaler), checksum verified."""
        data = _retried_read(lambda: self.fs.cat_file(f"{path}/{EXTRA_FILE}"))
        if sha256(data) != manifest["files"][EXTRA_FILE]["sha256"]:
            raise SnapshotError(f"snapshot {path}: {EXTRA_FILE} does not match its manifest checksum")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def load(self, path: str) -> tuple[dict, dict]:
        """(state, manifest) of one committed snapshot read whole by this process, every checksum
        verified: {"model": {name: tensor}, "optimizer": ..., "scaler", "sampler", "trainer"}.
        Training loads its share through mingpt.snapshot.restore instead."""
        manifest = self.read_manifest(path)
        missing = self.missing_files(path, manifest)
        if missing:
            raise SnapshotError(f"snapshot {path} is incomplete: {', '.join(missing)}")
        tensors = {name: torch.empty(e["shape"], dtype=dtype_of(e["dtype"])) for name, e in manifest["tensors"].items()}
        jobs = [(name, Piece.from_json(p), as_rows(t)[p[2]:p[3]]) for name, t in tensors.items()
                for p in manifest["tensors"][name]["pieces"]]
        errors = read_pieces(self, path, manifest, jobs)
        if errors:
            raise SnapshotError(f"snapshot {path}: {'; '.join(errors)}")
        state = {"model": {}, "optimizer": {}, **self.read_extra(path, manifest)}
        for name, t in tensors.items():
            kind, _, rest = name.partition(".")
            if kind == "model":
                state["model"][rest] = t
            else:
                param, _, key = rest.rpartition(".")
                state["optimizer"].setdefault(param, {})[key] = t
        for alias, target in manifest.get("aliases", {}).items():
            state["model"][alias.partition(".")[2]] = state["model"][target.partition(".")[2]]
        return state, manifest

    def verify(self, path: str) -> list[str]:
        """Every problem of one snapshot (missing or short files, pieces whose bytes changed); [] if none."""
        try:
            self.load(path)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            return [str(e)]
        return []

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


def open_store(url: str, endpoint_url: str | None, uploader: str = "s3fs") -> SnapshotStore:
    """The snapshot store, checked to be reachable now rather than at the first save."""
    storage_options = {"endpoint_url": endpoint_url} if endpoint_url else {}
    store = None
    try:
        store = SnapshotStore(url, storage_options, uploader=uploader)
        store.check()
    except Exception as e:  # noqa: BLE001 - any backend's connection or permission error
        if store is not None and store.local:
            raise SnapshotError(f"cannot use snapshot store {url} ({e.__class__.__name__}: {e}); point "
                                "snapshot.dir (or trainer.run_dir) at a directory you can write to") from None
        raise SnapshotError(
            f"cannot reach snapshot store {url} ({e.__class__.__name__}: {e}); check snapshot.dir, "
            "snapshot.endpoint_url and the AWS credentials / region in the environment"
        ) from None
    return store


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


def pread_into(file: str, offset: int, out: memoryview) -> None:
    """Fill `out` with the bytes of a local file from `offset` on."""
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise SnapshotError(f"{file} ends before byte {offset + len(out)}")
            done += n
    finally:
        os.close(fd)


def _shard_of(piece: Piece, manifest: dict) -> str:
    """The name of the shard file that holds `piece`."""
    return SHARD_FORMAT.format(piece.writer, manifest["writers"])


def _read_cached(cache, manifest: dict, jobs: list) -> list:
    """Fill the pieces that the node cache holds (each checked against its sha256); returns the jobs
    left for the store: not cached, or a damaged copy."""
    def one(job) -> bool:
        _, piece, out = job
        name = _shard_of(piece, manifest)
        file = cache.file(manifest["step"], name, manifest["files"][name]["size"])
        if file is None or not out.numel():
            return file is not None
        view = memoryview(out.numpy()).cast("B")
        try:
            pread_into(file, piece.offset, view)
        except (OSError, SnapshotError):
            return False
        return sha256(view) == piece.sha256

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshot-cache") as pool:
        done = list(pool.map(one, jobs))
    if any(done):
        log.info("node cache: %d of %d pieces read from %s", sum(done), len(jobs), cache.dir)
    return [job for job, ok in zip(jobs, done) if not ok]


def read_pieces(store: SnapshotStore, path: str, manifest: dict, jobs: list, cache=None) -> list[str]:
    """Read pieces (tensor name, Piece, uint8 rows view of the piece's rows) in parallel, each
    verified against its sha256; returns one message per damaged piece, naming its shard. Pieces
    that the node `cache` holds intact are read from it; the others from the store.

    Locally every piece is one positioned read straight into its tensor. From an object store the
    pieces of a file are read in few large ranged GETs (neighbouring pieces merged, up to
    READ_BYTES each) whose bytes are copied into the pieces: a GET has a fixed cost, and some
    servers (moto among them) read the whole object to answer any range."""
    if cache is not None and cache.enabled:
        jobs = _read_cached(cache, manifest, jobs)
    views = [(name, piece, memoryview(out.numpy()).cast("B") if out.numel() else memoryview(b""))
             for name, piece, out in jobs]
    fname = lambda piece: _shard_of(piece, manifest)  # noqa: E731
    failed: dict[int, str] = {}

    def local(i: int) -> None:
        name, piece, view = views[i]
        try:
            _retried_read(lambda: store.read_into(path, fname(piece), piece.offset, view))
        except Exception as e:  # noqa: BLE001 - any read failure names the shard
            failed[i] = f"shard {fname(piece)} cannot be read ({e.__class__.__name__}: {e})"

    def copy(chunk, pos: int, data) -> None:
        """Bytes [pos, pos + len(data)) of a chunk's file into the pieces they belong to."""
        for i in chunk[3]:
            _, piece, view = views[i]
            lo, hi = max(pos, piece.offset), min(pos + len(data), piece.offset + len(view))
            if lo < hi:
                view[lo - piece.offset:hi - piece.offset] = data[lo - pos:hi - pos]

    def ranged(chunk: tuple[str, int, int, list[int]]) -> None:
        file, start, end, members = chunk

        def get() -> None:
            if hasattr(store.fs, "_call_s3"):  # S3: stream the range, a few MiB in memory at a time
                fsspec.asyn.sync(store.fs.loop, _stream_s3, store.fs, f"{path}/{file}", start, end,
                                 lambda pos, data: copy(chunk, pos, data))
            else:
                data = store.fs.cat_file(f"{path}/{file}", start=start, end=end)
                if len(data) != end - start:
                    raise SnapshotError(f"{file} ends before byte {end}")
                copy(chunk, start, data)

        try:
            _retried_read(get)
        except Exception as e:  # noqa: BLE001 - any read failure names the shard
            for i in members:
                failed[i] = f"shard {file} cannot be read ({e.__class__.__name__}: {e})"

    def check(i: int) -> str | None:
        name, piece, view = views[i]
        if i in failed:
            return failed[i]
        if sha256(view) != piece.sha256:
            return f"shard {fname(piece)} fails its checksum (rows {piece.start}-{piece.stop} of {name})"
        return None

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshot-read") as pool:
        if store.local:
            list(pool.map(local, range(len(views))))
        else:
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapshot-get") as gets:
                list(gets.map(ranged, _chunks(views, fname)))
        return sorted({m for m in pool.map(check, range(len(views))) if m})


READ_ATTEMPTS = 3


def _retried_read(fn, attempts: int = READ_ATTEMPTS, backoff_s: float = 0.5) -> None:
    """fn() again after a failure (a dropped connection, a throttled GET), with backoff: one
    transient error must not make every rank pass over the newest snapshot. A short file stays short."""
    for attempt in range(attempts):
        try:
            return fn()
        except SnapshotError:
            raise
        except Exception as e:  # noqa: BLE001 - any backend's transient error
            if attempt == attempts - 1:
                raise
            log.warning("snapshot read failed (%s: %s); retrying in %.1fs", e.__class__.__name__, e,
                        backoff_s * 2**attempt)
            time.sleep(backoff_s * 2**attempt)


async def _stream_s3(fs, path: str, start: int, end: int, sink) -> None:
    """GET bytes [start, end) of an S3 object and hand them to sink(position, bytes) as they arrive."""
    bucket, key, _ = fs.split_path(path)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
    body, pos = resp["Body"], start
    try:
        while pos < end:
            data = await body.read(min(8 * 2**20, end - pos))
            if not data:
                raise SnapshotError(f"{path} ends before byte {end}")
            sink(pos, data)
            pos += len(data)
    finally:
        body.close()


READ_BYTES = 256 * 2**20


def _chunks(views: list, fname) -> list[tuple[str, int, int, list[int]]]:
    """(file, start, end, indices of the pieces it covers): the byte ranges to GET, pieces less
    than a part apart merged, none longer than READ_BYTES (a longer piece is cut)."""
    by_file: dict[str, list[int]] = {}
    for i, (_, piece, view) in enumerate(views):
        if len(view):
            by_file.setdefault(fname(piece), []).append(i)
    out = []
    for file, idx in by_file.items():
        idx.sort(key=lambda i: views[i][1].offset)
        start = end = None
        members: list[int] = []
        for i in idx:
            lo = views[i][1].offset
            hi = lo + len(views[i][2])
            if start is not None and lo - end <= PART_BYTES and hi - start <= READ_BYTES:
                end, members = max(end, hi), members + [i]
                continue
            if start is not None:
                out.append((file, start, end, members))
            start, end, members = lo, hi, [i]
            while end - start > READ_BYTES:  # one piece larger than a read: its own reads
                out.append((file, start, start + READ_BYTES, [i]))
                start += READ_BYTES
        if start is not None:
            out.append((file, start, end, members))
    return out
