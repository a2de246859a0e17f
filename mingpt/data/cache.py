"""Node-local token caches: a corpus is tokenized once per node (under a file lock, never keyed by
RANK) and memory-mapped by every process after that."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from mingpt.storage import atomic_write_bytes, file_lock
from mingpt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
