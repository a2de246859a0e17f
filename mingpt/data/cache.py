"""Node-local token caches: a corpus is tokenized once per node (under a file lock, never keyed by
RANK) and memory-mapped by every process after that."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import fsspec
import numpy as np

from mingpt.storage import atomic_write_bytes, file_lock, is_local, write_json_atomic
from mingpt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


def token_cache(text: str, tokenizer: Tokenizer, cache_dir: str) -> Path:
    """The node-local file of text's token ids, keyed by content and tokenizer (made when missing).

    The first process on each node to take the lock tokenizes; the others wait, then find it.
    """
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20] + "-" + tokenizer.fingerprint()
    root = Path(os.path.expanduser(cache_dir))
    path = root / f"tokens-{key}.{np.dtype(_dtype(tokenizer)).name}"
    if not path.exists():
        with file_lock(root / f".tokens-{key}.lock"):
            if not path.exists():
                log.info("tokenizing %d characters into %s", len(text), path)
                atomic_write_bytes(path, encode_array(text, tokenizer).tobytes())
    return path


def safe_cuts(text: str, chunk_chars: int) -> list[int]:
    """Chunk boundaries, about chunk_chars apart, where encoding the pieces gives the same tokens
    as encoding the whole: right after a newline that has a non-space before it and a non-space
    after it. GPT-2's pre-tokenizer never joins anything across such a point (a lone newline is a
    piece of its own, and only a space, not a newline, attaches to the word after it)."""
    def safe(i: int) -> bool:  # i: a newline's position
        return 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace()

    cuts, pos = [0], chunk_chars
    while pos < len(text):
        i = text.find("\n", pos)
        while i != -1 and not safe(i):
            i = text.find("\n", i + 1)
        if i == -1:
            break
        cuts.append(i + 1)
        pos = i + 1 + chunk_chars
    return cuts + [len(text)]


def encode_array(text: str, tokenizer: Tokenizer, chunk_chars: int = 1 << 22) -> np.ndarray:
    """text's token ids as one array, encoded chunk by chunk: memory for one batch of chunks' Python
    lists instead of the whole corpus's (about 30 bytes a token). BPE batches go to tiktoken's
    threads, one per core (on 2 cores that is no faster overall: building the lists holds the GIL)."""
    cuts = safe_cuts(text, chunk_chars)
    chunks = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    dtype, arrays = _dtype(tokenizer), []
    for start in range(0, len(chunks), threads):
        encoded = tokenizer.encode_batch(chunks[start : start + threads], threads)
        arrays.extend(np.asarray(e, dtype=dtype) for e in encoded)
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


def map_tokens(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    return np.memmap(path, dtype=_dtype(tokenizer), mode="r")


def _file_identity(path: str) -> list | None:
    if is_local(path):
        local = path.removeprefix("file://")
        st = os.stat(local)
        return [os.path.realpath(local), st.st_size, st.st_mtime_ns, st.st_ino]
    fs, key = fsspec.core.url_to_fs(path)
    info = fs.info(key)
    tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    return None if tag is None else [path, info.get("size"), str(tag)]


def source_identity(paths: list[str], settings: tuple = ()) -> str | None:
    """What changes when a corpus changes, found without reading it: each file's real path, size,
    modification time (ns) and inode, or on an object store its size and ETag; and the settings
    that shape the tokens (document format, separator, field). None where a file system tells
    neither (then the corpus is read and hashed, as before)."""
    try:
        parts = [_file_identity(p) for p in paths]
    except Exception:  # noqa: BLE001 - no cheap identity: fall back to reading the corpus
        return None
    if any(p is None for p in parts):
        return None
    return hashlib.sha256(json.dumps([parts, list(settings)]).encode()).hexdigest()[:20]


def _record_path(cache_dir: str, identity: str, tokenizer: Tokenizer | None) -> Path:
    which = tokenizer.fingerprint() if tokenizer is not None else "char-from-text"
    return Path(os.path.expanduser(cache_dir)) / f"source-{identity}-{which}.json"


def find_tokens(identity: str | None, tokenizer: Tokenizer | None, cache_dir: str) -> tuple[dict, list[Path]] | None:
    """A corpus tokenized before, found by its `source_identity`: (the tokenizer's state, the cache
    files), or None. `tokenizer` is None for a char vocabulary that would come from the text."""
    if identity is None:
        return None
    record = _record_path(cache_dir, identity, tokenizer)
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    files = [record.parent / name for name in known["files"]]
    return (known["tokenizer"], files) if all(f.exists() for f in files) else None


def remember_tokens(identity: str | None, tokenizer: Tokenizer | None, used: Tokenizer, files: list[Path],
                    cache_dir: str) -> None:
    """Record that the corpus of `identity`, tokenized by `used`, is in `files`. The identity is the
    one taken before the corpus was read: a file changed meanwhile is read again at the next start."""
    if identity is not None:
        write_json_atomic(_record_path(cache_dir, identity, tokenizer),
                          {"files": [f.name for f in files], "tokenizer": used.state_dict()})


def document_cache(docs: list[str], tokenizer: Tokenizer, cache_dir: str) -> tuple[Path, Path]:
    """The node-local files (ids, offsets) of every document's tokens followed by end-of-text,
    keyed by content and tokenizer (made when missing); see `map_documents`."""
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    key = h.hexdigest()[:20] + "-" + tokenizer.fingerprint()
    root = Path(os.path.expanduser(cache_dir))
    dtype = _dtype(tokenizer)
    ids_path, off_path = root / f"docs-{key}.{np.dtype(dtype).name}", root / f"docs-{key}.offsets.int64"
    if not off_path.exists():
        with file_lock(root / f".docs-{key}.lock"):
            if not off_path.exists():
                log.info("tokenizing %d documents into %s", len(docs), ids_path)
                # each document's Python list becomes an array at once: 2-4 bytes a token, not ~30
                encoded = [np.asarray(tokenizer.encode(d) + [tokenizer.eot_id], dtype=dtype) for d in docs]
                offsets = np.zeros(len(docs) + 1, dtype=np.int64)
                np.cumsum([len(e) for e in encoded], out=offsets[1:])
                atomic_write_bytes(ids_path, np.concatenate(encoded).tobytes())
                atomic_write_bytes(off_path, offsets.tobytes())  # written last: marks the cache complete
    return ids_path, off_path


def map_documents(ids_path: Path, off_path: Path, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets): document d is ids[offsets[d]:offsets[d+1]], the ids memory-mapped."""
    return map_tokens(ids_path, tokenizer), np.fromfile(off_path, dtype=np.int64)
