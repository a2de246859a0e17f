"""A corpus ready to train on: its tokenizer and both splits as datasets, from a prepared dataset.

A raw corpus goes through the same code: it is prepared into the node-local cache on first use
(one process per node, under a lock) and found again at later starts by its size and modification
time (or ETag), without reading it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np

from mingpt.config.schema import DataConfig, RunConfig
from mingpt.data.datasets import DocumentDataset, StreamDataset, split_pieces
from mingpt.data.encode import source_identity
from mingpt.data.prepare import MANIFEST, Settings, prepare
from mingpt.data.prepared import PreparedData, is_prepared
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler
from mingpt.data.sources import DataError, document_files, raw_format
from mingpt.model.gpt import GPT
from mingpt.model.tokenizer import Tokenizer, TokenizerError, build_bpe, from_state
from mingpt.runtime.distributed import default_threads
from mingpt.runtime.storage import file_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corpus:
    """What main.py assembles: the tokenizer and both splits as datasets."""

    tokenizer: Tokenizer
    train: StreamDataset | DocumentDataset
    val: StreamDataset | DocumentDataset
    source: str
    data: PreparedData

    def close(self) -> None:
        """Stop fetching shards ahead (a dataset on S3)."""
        self.data.close()


def _known_tokenizer(d: DataConfig, tokenizer_state: dict | None) -> Tokenizer | None:
    """The tokenizer known before reading a raw corpus: a resumed snapshot's char vocabulary wins
    (so the run encodes exactly as before), BPE needs only its ranks; None for a char vocabulary
    that will come from the text."""
    if tokenizer_state is not None and tokenizer_state.get("kind") == "char":
        return from_state(tokenizer_state)
    return build_bpe(d.tokenizer.ranks_file) if d.tokenizer.kind != "char" else None


def _describe(state: dict) -> str:
    if state["kind"] == "char":
        return f"char ({len(state['chars'])} characters{', with end-of-text' if state.get('eot') else ''})"
    return f"GPT-2 BPE (ranks sha256 {state['ranks_sha256'][:12]}...)"


def _same_tokenizer(a: dict, b: dict) -> bool:
    if a["kind"] != b["kind"]:
        return False
    if a["kind"] == "char":
        return a["chars"] == b["chars"] and bool(a.get("eot")) == bool(b.get("eot"))
    return a["ranks_sha256"] == b["ranks_sha256"]


def prepare_raw(d: DataConfig, tokenizer_state: dict | None) -> tuple[PreparedData, str]:
    """A raw corpus's prepared copy in the node-local cache (made on first use), and its source."""
    docs = d.kind == "documents"
    fmt = d.documents.format if docs else "text"
    files = document_files(d.path, fmt, d.fetch_default)
    file_fmt, separator = raw_format(fmt, d.documents.separator if docs else None)
    settings = Settings(fmt=file_fmt, separator=separator, text_field=d.documents.text_field,
                        val_fraction=d.val_fraction)
    known = _known_tokenizer(d, tokenizer_state)
    identity = source_identity(files, (repr(settings), docs)) or _content_key(files)
    cache, from_text = Path(os.path.expanduser(d.cache_dir)), ("chareot" if docs else "char") + "-from-text"
    out = cache / f"prepared-{identity}-{known.fingerprint() if known is not None else from_text}"
    first = cache / f"prepared-{identity}-{from_text}"  # what the run's first start prepared, its vocabulary from the text
    if known is not None and not (out / MANIFEST).exists() and _fingerprint(first) == known.fingerprint():
        out = first  # a resume with that same vocabulary: prepared once, not again under the tokenizer's name
    source = d.path if fmt == "files" else files[0]
    if not (out / MANIFEST).exists():
        with file_lock(out.with_name(f".{out.name}.lock")):
            if not (out / MANIFEST).exists():
                # the node's other processes wait on the lock: every core is free (a corpus of
                # one unit is prepared in this process)
                log.info("preparing %s into %s", source, out)
                prepare(files, str(out), settings, tokenizer=known, kind="char", workers=default_threads(1),
                        char_eot=docs, ranks_file=d.tokenizer.ranks_file)  # the workers rebuild a BPE from it
    return PreparedData(str(out), d.cache_dir, d.shard_cache_gb), source


def _fingerprint(prepared: Path) -> str | None:
    """The tokenizer fingerprint a prepared copy was made with, or None (not there, or unreadable)."""
    try:
        return json.loads((prepared / MANIFEST).read_text()).get("tokenizer_fingerprint")
    except (OSError, ValueError):
        return None


def _content_key(files: list[str]) -> str:
    """For a file system that tells neither modification time nor ETag: a hash of the content."""
    h = hashlib.sha256()
    for f in files:
        with fsspec.open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:20]


def load_corpus(d: DataConfig, tokenizer_state: dict | None = None) -> Corpus:
    """The corpus of the data config: a prepared dataset, or a raw corpus prepared on first use.

    Args:
        tokenizer_state: the tokenizer of a snapshot being resumed; a prepared dataset made with
            another one is refused, naming both.
    """
    if is_prepared(d.path):
        data, source = PreparedData(d.path, d.cache_dir, d.shard_cache_gb), d.path
        state = data.manifest["tokenizer"]
        if state["kind"] != d.tokenizer.kind:
            raise DataError(f"{d.path} was prepared with the {state['kind']} tokenizer; set "
                            f"data.tokenizer.kind={state['kind']} (it is data.tokenizer.kind={d.tokenizer.kind})")
        if tokenizer_state is not None and not _same_tokenizer(state, tokenizer_state):
            raise TokenizerError(f"the prepared dataset {d.path} was tokenized with {_describe(state)}, the snapshot "
                                 f"to resume with {_describe(tokenizer_state)}")
    else:
        data, source = prepare_raw(d, tokenizer_state)
    tokenizer = from_state(data.manifest["tokenizer"], d.tokenizer.ranks_file)
    m, T = data.manifest, d.block_size
    if d.kind != "documents":
        val_start = m["val_start_token"]
        return Corpus(tokenizer, StreamDataset(data.tokens, 0, val_start, T, "training"),
                      StreamDataset(data.tokens, val_start, m["tokens"], T, "validation"), source, data)
    if tokenizer.eot_id is None:
        raise DataError(f"{source} was prepared without an end-of-text token: document data needs one; "
                        "prepare it again with mingpt-prepare (which adds it)")
    ends = data.doc_ends()
    num_docs, n_val = len(ends), m["val_documents"]
    if n_val == 0 or n_val >= num_docs:
        raise DataError(f"{num_docs} documents are too few for a validation split of {m['settings']['val_fraction']}")
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])
    lengths = ends - starts
    splits = []
    for sl in (slice(0, num_docs - n_val), slice(num_docs - n_val, num_docs)):  # the last documents validate
        p_starts, p_lengths = split_pieces(starts[sl], lengths[sl], T + 1)
        splits.append(DocumentDataset(data.tokens, p_starts, p_lengths, T, tokenizer.eot_id))
    return Corpus(tokenizer, splits[0], splits[1], source, data)


def build_samplers(cfg: RunConfig, corpus: Corpus, model: GPT):
    """(training sampler, sampler over the validation split) of the data's kind."""
    d, seed = cfg.data, cfg.trainer.seed
    if d.kind == "stream":
        batch, micro = cfg.trainer.batch_size, cfg.trainer.micro_batch
        return (StreamSampler(len(corpus.train), batch, seed, micro), StreamSampler(len(corpus.val), batch, seed, micro))
    c = model.config
    attn_coeff = 12 * c.n_layer * c.n_embd / (6 * model.num_params())  # attention's T^2 term vs 6N per token
    docs = d.documents
    train, val = (LengthGroupedSampler(split.seq_lengths, docs.token_budget, docs.micro_batches_per_step, seed,
                                       docs.batching, docs.pool_size, attn_coeff) for split in (corpus.train, corpus.val))
    log.info("%s batching: %d global steps per epoch of %d micro-batches <= %d padded tokens", docs.batching,
             train.steps_per_epoch, docs.micro_batches_per_step, docs.token_budget)
    return train, val
