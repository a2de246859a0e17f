"""A corpus ready to train on: its tokenizer and both splits as datasets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mingpt.data.cache import (document_cache, find_tokens, map_documents, map_tokens, remember_tokens,
                               source_identity, token_cache)
from mingpt.data.datasets import DocumentDataset, StreamDataset, split_pieces, split_train_val
from mingpt.data.sources import DataError, document_files, locate_corpus, read_documents, read_text
from mingpt.tokenizer import CharTokenizer, Tokenizer, build_bpe, from_state


def _known_tokenizer(kind: str, ranks_file: str | None, tokenizer_state: dict | None) -> Tokenizer | None:
    """The tokenizer known before reading the corpus: a resumed snapshot's char vocabulary wins (so
    the run encodes exactly as before), BPE needs only its ranks; None for a char vocabulary that
    will come from the text."""
    if tokenizer_state is not None and tokenizer_state.get("kind") == "char":
        return from_state(tokenizer_state)
    return build_bpe(ranks_file) if kind != "char" else None


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

    A corpus tokenized before on this node is found by its size and modification time (or ETag),
    without reading it.

    Args:
        tokenizer_state: the tokenizer of a snapshot being resumed (see `_known_tokenizer`).
    """
    source = locate_corpus(path, fetch_default)
    known = _known_tokenizer(kind, ranks_file, tokenizer_state)
    identity = source_identity([source])
    found = find_tokens(identity, known, cache_dir)
    if found is not None:
        state, (tokens,) = found
        tokenizer = known if known is not None else from_state(state)
    else:
        text = read_text(source)
        tokenizer = known if known is not None else CharTokenizer.from_text(text)
        tokens = token_cache(text, tokenizer, cache_dir)
        remember_tokens(identity, known, tokenizer, [tokens], cache_dir)
    train_ids, val_ids = split_train_val(map_tokens(tokens, tokenizer), val_fraction)
    return Corpus(tokenizer, StreamDataset(train_ids, block_size), StreamDataset(val_ids, block_size), source)


def load_documents(path: str, fmt: str, separator: str, text_field: str, fetch_default: bool, kind: str,
                   ranks_file: str | None, cache_dir: str, block_size: int, val_fraction: float,
                   tokenizer_state: dict | None = None) -> Corpus:
    """Read, tokenize (cached), split by document, and cut into pieces of at most block_size+1.
    Like `load_corpus`, a corpus tokenized before on this node is found without reading it."""
    files = document_files(path, fmt, fetch_default)
    settings = ("documents", fmt, separator if fmt == "text" else None, text_field if fmt == "jsonl" else None)
    source = path if fmt == "files" else files[0]
    known = _known_tokenizer(kind, ranks_file, tokenizer_state)
    identity = source_identity(files, settings)
    found = find_tokens(identity, known, cache_dir)
    if found is not None:
        state, cached = found
        tokenizer = known if known is not None else from_state(state)
    else:
        docs = read_documents(path, fmt, separator, text_field, fetch_default, files)
        tokenizer = known if known is not None else CharTokenizer.from_text("".join(docs), eot=True)
        if tokenizer.eot_id is None:
            raise DataError("document data needs a tokenizer with an end-of-text token")
        cached = document_cache(docs, tokenizer, cache_dir)
        remember_tokens(identity, known, tokenizer, list(cached), cache_dir)
    ids, offsets = map_documents(*cached, tokenizer)
    num_docs = len(offsets) - 1
    n_val = max(1, int(num_docs * val_fraction))
    if n_val >= num_docs:
        raise DataError(f"{num_docs} documents are too few for a validation split of {val_fraction}")
    starts, lengths = offsets[:-1], np.diff(offsets)
    splits = []
    for sl in (slice(0, num_docs - n_val), slice(num_docs - n_val, num_docs)):  # the last documents validate
        p_starts, p_lengths = split_pieces(starts[sl], lengths[sl], block_size + 1)
        splits.append(DocumentDataset(ids, p_starts, p_lengths, block_size, tokenizer.eot_id))
    return Corpus(tokenizer, splits[0], splits[1], source)
