"""Character-level and GPT-2 BPE tokenizers behind one small interface.

A tokenizer's `state_dict()` is plain data (str/int), stored in every snapshot, so sampling
later decodes exactly as training encoded.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from mingpt.runtime.registry import sdist_files

log = logging.getLogger(__name__)

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
# The package registry is often the only thing an air-gapped cluster reaches; this source
# distribution ships GPT-2's ranks file.
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"


class TokenizerError(RuntimeError):
    """A tokenizer cannot be built; the message says how to fix it."""


class Tokenizer(Protocol):
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_ids(self, text: str) -> np.ndarray: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...
    def state_dict(self) -> dict: ...
    def fingerprint(self) -> str: ...


class CharTokenizer:
    """One id per distinct character of the training text, in sorted order; with `eot`, one more
    id (the last) marks the end of a document."""

    def __init__(self, chars: str, eot: bool = False):
        if not chars:
            raise TokenizerError("the character vocabulary is empty: the corpus has no text")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.eot_id = len(chars) if eot else None
        self.vocab_size = len(chars) + (1 if eot else 0)
        self._codes = None  # the sorted code points, for encode_ids (False: the vocabulary is not sorted)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise TokenizerError(
                f"character {e.args[0]!r} is not in this run's vocabulary of {self.vocab_size} characters"
            ) from None

    def encode_ids(self, text: str) -> np.ndarray:
        """encode() as an int64 array, vectorised: each code point looked up among the sorted ones."""
        if self._codes is None:
            codes = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)
            self._codes = codes if (np.diff(codes.astype(np.int64)) > 0).all() else False
        if self._codes is False:  # a vocabulary not in code point order: no lookup by sorting
            return np.asarray(self.encode(text), dtype=np.int64)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.minimum(np.searchsorted(self._codes, codes), len(self.chars) - 1)
        bad = np.flatnonzero(self._codes[ids] != codes)
        if len(bad):
            self.encode(text[bad[0]])  # raises, naming the character
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if i != self.eot_id else EOT for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return (self.chars[token] if token != self.eot_id else EOT).encode()

    def state_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars, "eot": self.eot_id is not None}

    def fingerprint(self) -> str:
        return ("chareot-" if self.eot_id is not None else "char-") + hashlib.sha256(self.chars.encode()).hexdigest()[:16]


class BPETokenizer:
    """GPT-2 byte-level BPE through tiktoken."""

    def __init__(self, encoding, ranks_sha256: str, ranks: dict[bytes, int] | None = None):
        self.enc = encoding
        self.ranks = ranks if ranks is not None else encoding._mergeable_ranks
        self.ranks_sha256 = ranks_sha256
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_ids(self, text: str) -> np.ndarray:
        """encode() as an array straight from tiktoken's buffer (no Python list: a quarter faster).
        With no special token allowed or disallowed, special-token text is ordinary text."""
        if hasattr(self.enc, "encode_to_numpy"):
            return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes: a multi-byte character may be split over tokens, so decode a stream of
        them with an incremental UTF-8 decoder."""
        return self.enc.decode_single_token_bytes(token)

    def vocab_and_merges(self) -> tuple[dict[str, int], list[str]]:
        """GPT-2's vocab.json and merges.txt (what Hugging Face's GPT-2 tokenizers read), rebuilt from
        the ranks: each token's merge is the last step of byte-pair-encoding its own bytes."""
        byte_char = _bytes_to_unicode()
        vocab = {"".join(byte_char[b] for b in token): rank for token, rank in self.ranks.items()}
        vocab[EOT] = self.eot_id
        merges = []
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            if len(token) < 2:
                continue
            left, right = _last_merge(token, self.ranks, rank)
            merges.append("".join(byte_char[b] for b in left) + " " + "".join(byte_char[b] for b in right))
        return vocab, merges

    def state_dict(self) -> dict:
        return {"kind": "bpe", "ranks_sha256": self.ranks_sha256}

    def fingerprint(self) -> str:
        return "gpt2-" + self.ranks_sha256[:16]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (vocab.json's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _last_merge(token: bytes, ranks: dict[bytes, int], rank: int) -> tuple[bytes, bytes]:
    """The two parts whose merge makes `token`: BPE over its bytes with the merges ranked before it."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1))
        if best[0] >= rank:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"the ranks file does not reach token {token!r} by merging two tokens")
    return parts[0], parts[1]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encoding_from_ranks(data: bytes, expected_sha256: str | None = GPT2_RANKS_SHA256, source: str = "?"):
    """A tiktoken Encoding for GPT-2 from the bytes of a `.tiktoken` ranks file."""
    import tiktoken

    digest = _sha256(data)
    if expected_sha256 is not None and digest != expected_sha256:
        raise TokenizerError(
            f"ranks file {source} has sha256 {digest}, expected {expected_sha256} (GPT-2's r50k_base); "
            "it is corrupt or a different vocabulary"
        )
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    enc = tiktoken.Encoding(
        name="gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
    )
    return enc, digest, ranks


def _ranks_from_registry() -> bytes:
    """GPT-2's ranks from the openai-whisper source distribution on the package registry."""
    return sdist_files(WHISPER_SDIST, WHISPER_MEMBER)[0]


def build_bpe(ranks_file: str | None) -> BPETokenizer:
    """GPT-2 BPE: from ranks_file if given, else tiktoken's download, else the package registry."""
    if ranks_file:
        path = Path(os.path.expanduser(ranks_file))
        if not path.is_file():
            raise TokenizerError(
                f"tokenizer ranks file {path} does not exist; point data.tokenizer.ranks_file at GPT-2's "
                "r50k_base.tiktoken (sha256 " + GPT2_RANKS_SHA256 + ")"
            )
        enc, digest, ranks = encoding_from_ranks(path.read_bytes(), source=str(path))
        return BPETokenizer(enc, digest, ranks)
    errors = []
    try:
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")
        return BPETokenizer(enc, GPT2_RANKS_SHA256)
    except Exception as e:  # noqa: BLE001 - every failure here means "try the next source"
        errors.append(f"tiktoken download: {e.__class__.__name__}: {e}")
    try:
        log.info("tiktoken could not download GPT-2's ranks; taking them from %s on the package registry",
                 WHISPER_SDIST)
        enc, digest, ranks = encoding_from_ranks(_ranks_from_registry(), source=WHISPER_SDIST)
        return BPETokenizer(enc, digest, ranks)
    except Exception as e:  # noqa: BLE001
        errors.append(f"package registry ({WHISPER_SDIST}): {e.__class__.__name__}: {e}")
    raise TokenizerError(
        "could not load GPT-2's BPE ranks from any source ("
        + "; ".join(errors)
        + "). Copy r50k_base.tiktoken to this machine and set data.tokenizer.ranks_file=/path/to/r50k_base.tiktoken"
    )


def from_state(state: dict, ranks_file: str | None = None) -> Tokenizer:
    """Rebuild the tokenizer a run was trained with, from its snapshot state."""
    if state["kind"] == "char":
        return CharTokenizer(state["chars"], state.get("eot", False))
    if state["kind"] == "bpe":
        tok = build_bpe(ranks_file)
        if tok.ranks_sha256 != state["ranks_sha256"]:
            raise TokenizerError("the BPE ranks differ from the ones this snapshot was trained with")
        return tok
    raise TokenizerError(f"unknown tokenizer kind {state['kind']!r} in snapshot")
