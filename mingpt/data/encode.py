"""Tokenizing text into compact arrays, and the cheap identity of a raw corpus (found without
reading it) under which its prepared copy is kept in the node-local cache."""

from __future__ import annotations

import hashlib
import json
import os

import fsspec
import numpy as np

from mingpt.model.tokenizer import Tokenizer
from mingpt.runtime.storage import is_local


def token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


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
    """text's token ids as one compact array, encoded chunk by chunk (cut by `safe_cuts`, so the
    same ids as one call): memory for one chunk's intermediate ids, not the whole text's.
    Parallelism is prepare's: one process per core, each encoding its own units."""
    cuts = safe_cuts(text, chunk_chars)
    dtype = token_dtype(tokenizer)
    arrays = [tokenizer.encode_ids(text[a:b]).astype(dtype, copy=False) for a, b in zip(cuts[:-1], cuts[1:])]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


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
