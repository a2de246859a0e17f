"""Reading a prepared dataset (see data/prepare.py): start-up reads the manifest alone (and the index,
for documents); local shards are memory-mapped; shards on S3 are copied by a background thread
(parallel range reads) into a bounded node-local cache, and read by range until their copy is there."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mingpt.data.prepare import MANIFEST, DatasetDir
from mingpt.data.sources import DataError, unreachable
from mingpt.runtime.storage import file_lock

log = logging.getLogger(__name__)

RANGE_BYTES = 16 * 2**20  # one range read
RANGES_IN_FLIGHT = 8
READ_ATTEMPTS = 3


class StreamError(OSError):
    """A remote shard could not be read during training, after retries (a timeout, a dropped
    connection): not a fault of the dataset, so the run exits with 1 and torchrun restarts it."""


def read_range(fs, url: str, start: int, end: int, backoff_s: float = 0.5) -> bytes:
    """Bytes [start, end) of a remote file, retried with backoff: one dropped GET must not stop a
    run. A missing or forbidden file is the dataset's or the settings' fault (DataError)."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return fs.cat_file(url, start=start, end=end)
        except (FileNotFoundError, PermissionError) as e:
            raise unreachable(url, e) from None
        except Exception as e:  # noqa: BLE001 - any backend's transient error
            if attempt == READ_ATTEMPTS - 1:
                raise StreamError(f"reading {url} failed {READ_ATTEMPTS} times ({e.__class__.__name__}: {e}); "
                                  "exiting so that torchrun restarts the workers") from None
            log.warning("reading %s failed (%s: %s); retrying in %.1fs", url, e.__class__.__name__, e,
                        backoff_s * 2**attempt)
            time.sleep(backoff_s * 2**attempt)


def is_prepared(path: str) -> bool:
    """Whether `path` is a prepared dataset, complete or not (a manifest, or the plan of one)."""
    try:
        place = DatasetDir(path)
        return place.fs.isdir(place.root) and any(place.size(name) is not None for name in (MANIFEST, "work/plan.json"))
    except Exception:  # noqa: BLE001 - unreachable: reading it as a raw corpus says why
        return False


class ShardCache:
    """Node-local copies of a remote dataset's files, at most `limit` bytes, least recently used
    evicted first. Each file is downloaded once per node, under a node-local lock (never keyed by
    RANK), and checked against the manifest's sha256 before anyone uses it."""

    def __init__(self, place: DatasetDir, cache: Path, limit: int):
        self.place, self.dir, self.limit = place, cache, limit
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.dir / name.replace("/", "__")

    def usage(self) -> int:
        return sum(_size(p) for p in self.dir.glob("*.bin"))

    def get(self, entry: dict) -> Path:
        """The local copy of `entry` (name, bytes, sha256), downloaded if missing."""
        path = self._path(entry["name"])
        while True:
            if not self._present(path, entry):
                with file_lock(self.dir / f".{path.name}.lock"):
                    if not self._present(path, entry):
                        self._download(entry, path)
            try:
                os.utime(path)  # recently used
                return path
            except FileNotFoundError:  # another local rank evicted it in between: fetch it again
                continue

    def try_get(self, entry: dict) -> bool:
        """Download `entry` unless it is here or another process on this node is at it; never waits."""
        path = self._path(entry["name"])
        if self._present(path, entry):
            return True
        with open(self.dir / f".{path.name}.lock", "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                if not self._present(path, entry):
                    self._download(entry, path)
                return True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def _present(path: Path, entry: dict) -> bool:
        try:
            return path.stat().st_size == entry["bytes"]
        except FileNotFoundError:
            return False

    def _download(self, entry: dict, path: Path) -> None:
        """Range reads, RANGES_IN_FLIGHT at a time, written in order to a temporary file and hashed
        on the way (memory for the ranges in flight, not the shard); renamed into place only when
        the checksum matches."""
        self._evict(entry["bytes"])
        url, size = self.place.path(entry["name"]), entry["bytes"]
        ranges = [(a, min(size, a + RANGE_BYTES)) for a in range(0, size, RANGE_BYTES)]
        digest, written = hashlib.sha256(), 0
        tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            with ThreadPoolExecutor(RANGES_IN_FLIGHT) as pool, open(tmp, "wb") as fh:
                for i in range(0, len(ranges), RANGES_IN_FLIGHT):
                    window = ranges[i : i + RANGES_IN_FLIGHT]
                    for part in pool.map(lambda r: read_range(self.place.fs, url, *r), window):
                        fh.write(part)
                        digest.update(part)
                        written += len(part)
                fh.flush()
                os.fsync(fh.fileno())  # a copy that survives a power loss, or none
            if written != size or digest.hexdigest() != entry["sha256"]:
                raise DataError(f"shard {entry['name']} of {self.place.root} fails its checksum (sha256 "
                                f"{digest.hexdigest()[:12]}..., {written} bytes; the manifest says "
                                f"{entry['sha256'][:12]}..., {size} bytes): the stored copy is damaged; prepare the "
                                "dataset again or restore that file")
            os.replace(tmp, path)
        except (DataError, StreamError):
            raise
        except Exception as e:  # noqa: BLE001
            raise unreachable(url, e) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _evict(self, need: int) -> None:
        """Make room for `need` more bytes: remove the least recently used copies. A process that
        has one mapped keeps reading it (the file lives on until unmapped). Other local ranks evict
        too: a file may vanish between the listing and its stat."""
        files = []
        for p in self.dir.glob("*.bin"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        files.sort()
        total = sum(size for _, size, _ in files)
        while files and total + need > self.limit:
            _, size, victim = files.pop(0)
            total -= size
            victim.unlink(missing_ok=True)


def _size(p: Path) -> int:
    """A file's size, 0 when another process removed it meanwhile."""
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


class TokenStream:
    """The token ids of a dataset: one stream over its shards, each mapped when first used."""

    def __init__(self, sizes: list[int], open_shard):
        self.bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.bounds[1:])
        self._open, self._maps, self._lock = open_shard, {}, threading.Lock()

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def _shard(self, k: int) -> np.ndarray:
        arr = self._maps.get(k)
        if arr is None:
            with self._lock:
                arr = self._maps.get(k)
                if arr is None:
                    arr = self._maps[k] = self._open(k)
        return arr

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the stream."""
        k = int(np.searchsorted(self.bounds, a, side="right")) - 1
        parts = []
        while a < b:
            lo, hi = int(self.bounds[k]), int(self.bounds[k + 1])
            take = min(b, hi)
            parts.append(self._shard(k)[a - lo : take - lo])
            a, k = take, k + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def window(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64: row i is tokens [starts[i], starts[i] + length)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, a in enumerate(starts):
            out[i] = self.read(int(a), int(a) + length)
        return out


class RemoteShard:
    """A shard on S3 read by slicing: from its verified local copy once the cache has it, before
    that by a range read of just the tokens asked for (and the whole shard is queued for the
    cache). What was read by range is checked when the copy is: a damaged shard stops the run at
    the next read, naming it."""

    def __init__(self, data: PreparedData, k: int):
        self.data, self.k, self.entry = data, k, data.manifest["shards"][k]
        self.path, self.copy = data.cache._path(self.entry["name"]), None

    def __getitem__(self, sl: slice) -> np.ndarray:
        data = self.data
        if data.error is not None:
            raise data.error
        if self.copy is None and ShardCache._present(self.path, self.entry):
            try:  # another local rank may evict it at any moment; once mapped, it stays readable
                self.copy = np.memmap(self.path, dtype=data.dtype, mode="r")
                os.utime(self.path)
            except FileNotFoundError:
                pass
        if self.copy is not None:
            return self.copy[sl]
        if self.k not in data._asked:
            data._asked.add(self.k)
            data._wanted.put(self.k)
        size = data.dtype.itemsize
        raw = read_range(data.place.fs, data.place.path(self.entry["name"]), sl.start * size, sl.stop * size)
        return np.frombuffer(raw, dtype=data.dtype)


class PreparedData:
    """An opened prepared dataset: its manifest, its token stream, and its index when asked."""

    def __init__(self, url: str, cache_dir: str, cache_gb: float):
        try:
            self.place = DatasetDir(url)
            raw, m = self.place.manifest()
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise unreachable(url, e) from None
        self.manifest = m
        self.dtype = np.dtype(m["dtype"])
        self.cache = None
        if not self.place.local:
            key = hashlib.sha256((self.place.url + hashlib.sha256(raw).hexdigest()).encode()).hexdigest()[:16]
            self.cache = ShardCache(self.place, Path(os.path.expanduser(cache_dir)) / "shards" / key,
                                    int(cache_gb * 2**30))
            self._check_disk()
        else:
            for s in m["shards"]:
                size = os.path.getsize(self.place.path(s["name"])) if os.path.exists(self.place.path(s["name"])) else None
                if size != s["bytes"]:
                    raise DataError(f"shard {s['name']} of {self.place.url} has {size} bytes, the manifest says {s['bytes']}: "
                                    "it is damaged or missing; prepare the dataset again or restore that file")
        self.tokens = TokenStream([s["tokens"] for s in m["shards"]], self._open_shard)
        self._stop, self.error = threading.Event(), None
        self._wanted, self._asked = queue.Queue(), set()
        if self.cache is not None:
            threading.Thread(target=self._prefetch, name="shard-prefetch", daemon=True).start()

    def _check_disk(self) -> None:
        want = min(self.cache.limit, sum(s["bytes"] for s in self.manifest["shards"]))
        free = shutil.disk_usage(self.cache.dir).free + self.cache.usage()
        if want > free:
            raise DataError(f"the shard cache {self.cache.dir} needs {want / 2**30:.1f} GiB (data.shard_cache_gb="
                            f"{self.cache.limit / 2**30:g}) but its disk has {free / 2**30:.1f} GiB free; lower "
                            "data.shard_cache_gb or point data.cache_dir at a larger disk")

    def _open_shard(self, k: int):
        entry = self.manifest["shards"][k]
        if self.place.local:
            return np.memmap(self.place.path(entry["name"]), dtype=self.dtype, mode="r")
        return RemoteShard(self, k)

    def _prefetch(self) -> None:
        """Copy shards into the cache while training runs, those a step asked for first, then the
        others in stream order, up to the cache's limit: in steady state steps read local disk.
        Local ranks share the work (a shard another process is downloading is skipped). An error
        (a damaged shard, S3 gone) is kept and raised by the next read."""
        shards = self.manifest["shards"]
        order = iter(range(len(shards)))
        while not self._stop.is_set():
            try:
                k = self._wanted.get_nowait()
            except queue.Empty:
                k = next(order, None)
                if k is None:
                    k = self._wanted.get()  # everything is here, or was tried: serve requests only
                    if k is None:
                        return
            entry = shards[k]
            if ShardCache._present(self.cache._path(entry["name"]), entry):
                continue
            if self.cache.usage() + entry["bytes"] > self.cache.limit and k not in self._asked:
                continue
            try:
                self.cache.try_get(entry)
            except (DataError, StreamError) as e:
                self.error = e
                return
            except Exception as e:  # noqa: BLE001 - anything else would end this thread silently
                self.error = DataError(f"copying shard {entry['name']} of {self.place.url} into {self.cache.dir} "
                                       f"failed ({e.__class__.__name__}: {e})")
                return

    def close(self) -> None:
        self._stop.set()
        if self.cache is not None:
            self._wanted.put(None)

    def doc_ends(self) -> np.ndarray:
        """Where each document ends (tokens from the start of the stream), int64."""
        entry = self.manifest["index"]
        if self.place.local:
            return np.fromfile(self.place.path(entry["name"]), dtype=np.int64)
        return np.fromfile(self.cache.get(entry), dtype=np.int64)
