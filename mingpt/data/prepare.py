"""Prepare a corpus once: tokenize it in parallel into a prepared dataset that training opens in
constant time.

A prepared dataset (a local directory or an s3:// prefix):

    shards/u000012-000.bin   token ids of unit 12, part 0 (uint16 when the vocabulary fits, else uint32)
    index.int64              where each document ends, in tokens from the start of the stream
    manifest.json            written last: the dataset is complete only with it (see prepared.is_prepared)
    work/plan.json, work/unit-000012.json, work/unit-000012.ends
                             the plan and each finished unit: what an interrupted run continues from

The token stream is the shards in name order. Every document ends with the end-of-text token when
the tokenizer has one. Each unit's output depends on that unit alone, so one process, many
processes and many nodes write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import fsspec
import numpy as np

from mingpt.data.encode import encode_array, token_dtype
from mingpt.data.sources import DataError, Unit, expand_inputs, file_units, input_format, unit_documents, work_bytes
from mingpt.model.tokenizer import CharTokenizer, Tokenizer, TokenizerError, build_bpe, from_state
from mingpt.runtime.storage import atomic_write_bytes, is_local

log = logging.getLogger(__name__)

FORMAT, VERSION = "mingpt-prepared", 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Settings:
    """What shapes the tokens: the same settings over the same inputs give the same dataset."""

    fmt: str = "auto"  # auto (by extension) | text | jsonl | parquet
    separator: str | None = None  # text files: what separates documents (None: a file is one document)
    text_field: str = "text"  # JSON field / Parquet column holding the text
    val_fraction: float = 0.1  # the last documents (of a single document: the last tokens) validate
    unit_bytes: int = 64 * 2**20  # input bytes per unit of work
    shard_bytes: int = 256 * 2**20  # token bytes per shard at most


class DatasetDir:
    """A prepared dataset's directory or prefix, local or on an object store: local files are
    written atomically, objects whole."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = is_local(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def write(self, name: str, data: bytes) -> None:
        if self.local:
            atomic_write_bytes(Path(self.path(name)), data)
        else:
            self.fs.pipe_file(self.path(name), data)

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.info(self.path(name))["size"])
        except FileNotFoundError:
            return None

    def manifest(self) -> tuple[bytes, dict]:
        """The manifest (its bytes and content) of a complete dataset of this version, or one clear
        error: a dataset without one was interrupted while it was prepared."""
        raw = self.read(MANIFEST)
        if raw is None:
            raise DataError(f"{self.url} has no {MANIFEST}: its preparation was interrupted. Run the same "
                            "mingpt-prepare command again: it continues where it stopped")
        manifest = json.loads(raw)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise DataError(f"{self.url}/{MANIFEST} is not a {FORMAT} manifest of version {VERSION}; prepare the "
                            "dataset again with this version of mingpt-prepare")
        return raw, manifest


# ---- one unit of work (runs in worker processes) ----

_worker_tokenizer: Tokenizer | None = None


_worker_error: Exception | None = None


def _init_worker(tokenizer_state: dict, ranks_file: str | None) -> None:
    # An initializer that raises makes the pool start a new worker, forever: keep the error for
    # the first unit to raise instead.
    global _worker_tokenizer, _worker_error
    try:
        _worker_tokenizer = from_state(tokenizer_state, ranks_file)
    except Exception as e:  # noqa: BLE001
        _worker_error = e


def _unit_tokens(unit: Unit, settings: Settings, tokenizer: Tokenizer) -> Iterator[tuple[np.ndarray, bool]]:
    """(token ids, whether a document ends with them) for each text of the unit."""
    eot = tokenizer.eot_id
    for text, ends in unit_documents(unit, settings.separator, settings.text_field):
        ids = encode_array(text, tokenizer)
        if ends and eot is not None:
            ids = np.append(ids, np.asarray([eot], dtype=ids.dtype))
        yield ids, ends


def unit_name(k: int) -> str:
    return f"unit-{k:06d}"


def prepare_unit(job: tuple[int, Unit, Settings, str]) -> dict:
    """Tokenize one unit into shards of at most settings.shard_bytes, then commit it with its record (written
    last). Returns the record."""
    k, unit, settings, out = job
    if _worker_error is not None:
        raise _worker_error
    tokenizer = _worker_tokenizer
    dest, dtype = DatasetDir(out), token_dtype(tokenizer)
    limit = max(1, settings.shard_bytes // np.dtype(dtype).itemsize)
    shards, ends, pending, pending_n, total = [], [], [], 0, 0

    def flush() -> None:
        nonlocal pending, pending_n
        data = np.concatenate(pending).astype(dtype, copy=False).tobytes()
        name = f"shards/u{k:06d}-{len(shards):03d}.bin"
        dest.write(name, data)
        shards.append({"name": name, "tokens": pending_n, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        pending, pending_n = [], 0

    try:
        for ids, doc_ends in _unit_tokens(unit, settings, tokenizer):
            while len(ids):
                take = ids[: limit - pending_n]
                pending.append(take)
                pending_n += len(take)
                total += len(take)
                ids = ids[len(take):]
                if pending_n == limit:
                    flush()
            if doc_ends:
                ends.append(total)
    except TokenizerError as e:
        raise TokenizerError(f"{unit.path}: {e}") from None
    if pending_n:
        flush()
    ends_bytes = np.asarray(ends, dtype=np.int64).tobytes()
    dest.write(f"work/{unit_name(k)}.ends", ends_bytes)
    record = {"unit": k, "path": unit.path, "bytes": work_bytes(unit), "tokens": total, "documents": len(ends),
              "shards": shards, "ends_sha256": hashlib.sha256(ends_bytes).hexdigest()}
    dest.write(f"work/{unit_name(k)}.json", json.dumps(record).encode())
    return record


def _unit_chars(job: tuple[Unit, Settings]) -> str:
    unit, settings = job
    chars: set[str] = set()
    for text, _ in unit_documents(unit, settings.separator, settings.text_field):
        chars.update(text)
    return "".join(sorted(chars))


# ---- the whole preparation ----

def plan_units(files: list[str], settings: Settings) -> list[Unit]:
    units = []
    for f in files:
        units.extend(file_units(f, input_format(f, settings.fmt), settings.separator, settings.unit_bytes,
                                settings.text_field))
    return units


def char_tokenizer(units: list[Unit], settings: Settings, workers: int, eot: bool) -> CharTokenizer:
    """A character vocabulary from every character of the inputs (a first pass over them)."""
    jobs = [(u, settings) for u in units]
    with _pool(min(workers, len(jobs)), None) as pool:  # no process started for one unit
        parts = pool.map(_unit_chars, jobs) if pool else list(map(_unit_chars, jobs))
    return CharTokenizer("".join(sorted(set("".join(parts)))), eot=eot)


class _pool:
    """A process pool of `workers` (spawned: no inherited threads), or None for one process."""

    def __init__(self, workers: int, init: tuple | None):
        self.workers, self.init, self.pool = workers, init, None

    def __enter__(self):
        if self.workers > 1:
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(self.workers, _init_worker if self.init else None, self.init or ())
        elif self.init:
            _init_worker(*self.init)
        return self.pool

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()


def default_workers() -> int:
    """The cores of this machine, shared by the processes torchrun started on it."""
    from mingpt.runtime.distributed import default_threads  # imported here: the workers need no torch

    return default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def _finished(dest: DatasetDir, k: int) -> dict | None:
    """The record of a unit committed by an earlier run, if its files are all there."""
    raw = dest.read(f"work/{unit_name(k)}.json")
    if raw is None:
        return None
    record = json.loads(raw)
    if dest.size(f"work/{unit_name(k)}.ends") != 8 * record["documents"]:
        return None
    return record if all(dest.size(s["name"]) == s["bytes"] for s in record["shards"]) else None


def prepare(inputs: list[str], out: str, settings: Settings, tokenizer: Tokenizer | None = None,
            kind: str = "bpe", ranks_file: str | None = None, workers: int = 0, rank: int = 0, world_size: int = 1,
            barrier=None, progress: bool = False, char_eot: bool = True) -> dict:
    """Prepare `inputs` into `out` and return the manifest; continue an interrupted preparation.

    `tokenizer`: the one to use; None builds `kind` (a char vocabulary from the inputs, with an
    end-of-text token unless char_eot is False). Under torchrun, rank r of world_size takes every world_size-th unit and
    rank 0 writes the index and the manifest once every unit is done (`barrier` waits for all).
    """
    dest, workers = DatasetDir(out), workers or default_workers()
    files = expand_inputs(inputs)
    units = plan_units(files, settings)
    described = [{"path": f, "bytes": s} for f, s in _sizes(units)]
    done = dest.read(MANIFEST)
    if done is not None:
        manifest = json.loads(done)
        if (manifest.get("settings"), manifest.get("inputs")) != (asdict(settings), described) or (
                tokenizer is not None and manifest.get("tokenizer") != tokenizer.state_dict()):
            raise DataError(f"{out} already holds a prepared dataset of other inputs or settings; use another --out")
        log.info("%s is already prepared from these inputs", out)
        return manifest
    if tokenizer is None:
        tokenizer = build_bpe(ranks_file) if kind == "bpe" else char_tokenizer(units, settings, workers, char_eot)
    plan = {"format": FORMAT, "version": VERSION, "settings": asdict(settings), "tokenizer": tokenizer.state_dict(),
            "inputs": described, "units": len(units)}
    _check_plan(dest, plan, rank, barrier)
    mine = [k for k in range(len(units)) if k % world_size == rank]
    todo = [k for k in mine if _finished(dest, k) is None]
    if len(todo) < len(mine):
        log.info("continuing an interrupted preparation in %s: %d of %d units already done", out,
                 len(mine) - len(todo), len(mine))
    bar = _progress(sum(work_bytes(units[k]) for k in todo), progress)
    jobs = [(k, units[k], settings, dest.url) for k in todo]
    with _pool(min(workers, max(1, len(jobs))), (tokenizer.state_dict(), ranks_file)) as pool:
        for record in (pool.imap_unordered(prepare_unit, jobs) if pool else map(prepare_unit, jobs)):
            bar.update(record["bytes"])
            bar.tokens += record["tokens"]
            bar.set_postfix_str(f"{bar.tokens / 1e6:,.1f}M tokens", refresh=False)
    bar.close()
    if barrier is not None:
        barrier()
    if rank == 0:
        _commit(dest, plan, tokenizer, settings, len(units))
    if barrier is not None:
        barrier()
    return json.loads(dest.read(MANIFEST))


def _sizes(units: list[Unit]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for u in units:
        seen.setdefault(u.path, u.size)
    return list(seen.items())


def _check_plan(dest: DatasetDir, plan: dict, rank: int, barrier) -> None:
    """An output that holds another preparation (other inputs or settings) is never mixed into."""
    raw = dest.read("work/plan.json")
    if raw is not None and json.loads(raw) != plan:
        raise DataError(f"{dest.url} holds an unfinished preparation of other inputs or settings; use another "
                        "--out, or delete that directory to start it over")
    if raw is None and rank == 0:
        dest.write("work/plan.json", json.dumps(plan).encode())
    if barrier is not None:
        barrier()


def _commit(dest: DatasetDir, plan: dict, tokenizer: Tokenizer, settings: Settings, num_units: int) -> dict:
    """The index, then the manifest (last): the dataset is complete."""
    records = [_finished(dest, k) for k in range(num_units)]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        raise DataError(f"{len(missing)} units of {dest.url} are not done (first: {missing[0]}); run the same "
                        "command again to finish them")
    if dest.local:  # a worker killed mid-write left its temporary file (atomic_write_bytes): not the dataset's
        for stray in [*Path(dest.root).glob("shards/.u*.bin.*"), *Path(dest.root).glob("work/.unit-*")]:
            stray.unlink(missing_ok=True)
    ends, shards, base = [], [], 0
    for k, r in enumerate(records):
        local_ends = np.frombuffer(dest.read(f"work/{unit_name(k)}.ends"), dtype=np.int64)
        ends.append(local_ends + base)
        shards.extend(r["shards"])
        base += r["tokens"]
    index = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    if base == 0:
        raise DataError(f"the inputs of {dest.url} hold no text")
    if len(index) == 0 or index[-1] != base:  # a stream whose last text has no document end
        index = np.append(index, np.int64(base))
    docs = len(index)
    if docs >= 2:
        n_val = max(1, int(docs * settings.val_fraction))
        if n_val >= docs:
            n_val = docs - 1
        val_start = int(index[docs - n_val - 1])
    else:  # one document: its last tokens validate
        n_val, val_start = 0, base - int(base * settings.val_fraction)
    index_bytes = index.tobytes()
    dest.write("index.int64", index_bytes)
    manifest = {**{k: plan[k] for k in ("format", "version", "settings", "tokenizer", "inputs")},
                "tokenizer_fingerprint": tokenizer.fingerprint(), "dtype": np.dtype(token_dtype(tokenizer)).name,
                "tokens": base, "documents": docs, "val_documents": n_val, "val_start_token": val_start,
                "index": {"name": "index.int64", "bytes": len(index_bytes),
                          "sha256": hashlib.sha256(index_bytes).hexdigest()},
                "shards": shards, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    dest.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def _progress(total_bytes: int, show: bool):
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preparing", disable=not show,
               dynamic_ncols=True, file=sys.stderr)
    bar.tokens = 0
    return bar


VERIFY_READ_BYTES = 16 * 2**20


def verify(url: str) -> list[str]:
    """Every file a prepared dataset's manifest names, read whole and checked against its size and
    sha256: the damaged or missing ones, each named ([] when all are whole)."""
    place = DatasetDir(url)
    try:
        _, manifest = place.manifest()
    except DataError as e:
        return [str(e)]
    problems = []
    for entry in [*manifest["shards"], manifest["index"]]:
        digest, size = hashlib.sha256(), 0
        try:
            with place.fs.open(place.path(entry["name"]), "rb") as fh:
                while chunk := fh.read(VERIFY_READ_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            problems.append(f"{entry['name']} is missing")
            continue
        if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            problems.append(f"{entry['name']} fails its checksum ({size} bytes, sha256 {digest.hexdigest()[:12]}...; "
                            f"the manifest says {entry['bytes']} bytes, {entry['sha256'][:12]}...)")
    return problems
