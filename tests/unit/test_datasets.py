"""The datasets over prepared tokens (mingpt/data/datasets.py): blocks of a stream, and documents cut into
pieces, padded and split."""


import numpy as np
from conftest import load_documents, make_docs_corpus, token_stream

from mingpt.data.datasets import StreamDataset, split_pieces
from mingpt.data.prepared import TokenStream


def test_stream_dataset_targets_are_inputs_shifted():
    ds = StreamDataset(token_stream(np.arange(101, dtype=np.uint16)), 0, 101, 10, "training")
    assert len(ds) == 10
    x, y = ds.batch(np.array([3, 0]))
    assert x[0].tolist() == list(range(30, 40)) and y[0].tolist() == list(range(31, 41))
    assert x[1, 0] == 0


def test_blocks_read_across_shard_boundaries():
    parts = [np.arange(0, 7), np.arange(7, 8), np.arange(8, 30)]
    stream = TokenStream([len(p) for p in parts], lambda k: parts[k])
    ds = StreamDataset(stream, 4, 30, 5, "training")
    x, y = ds.batch(np.array([0, 1]))
    assert x.tolist() == [[4, 5, 6, 7, 8], [9, 10, 11, 12, 13]] and y[0].tolist() == [5, 6, 7, 8, 9]


def test_split_pieces():
    starts, lengths = split_pieces(np.array([0, 10, 11]), np.array([10, 1, 25]), max_len=8)
    assert lengths.tolist() == [8, 2, 8, 8, 8]  # the 1-token document and a 1-token tail are dropped
    assert starts.tolist() == [0, 8, 11, 19, 27]


def test_document_dataset_pieces_eot_padding_and_split(tmp_path):
    corpus = make_docs_corpus(tmp_path, n=200)
    c = load_documents(corpus, "text", tmp_path / "cache", block_size=32)
    eot = c.tokenizer.eot_id
    assert eot == c.tokenizer.vocab_size - 1
    assert c.train.lengths.max() <= 33 and c.train.lengths.min() >= 2
    # the validation documents are the last 10%, disjoint from training
    assert c.val.starts.min() > c.train.starts.max()
    idx = np.array([int(np.argmin(c.train.lengths)), int(np.argmax(c.train.lengths))])
    x, y = c.train.batch(idx)
    short = int(c.train.seq_lengths[idx[0]])
    assert x.shape == (2, 32) and (y[0, short:] == -100).all() and (y[0, :short] >= 0).all()
    assert c.train.tokens_in(idx) == short + 32
    head = c.train.tokens.read(0, 200)
    first_doc = head[: c.train.lengths[0]]
    text = c.tokenizer.decode(head.tolist())
    assert "<|endoftext|>" in text and eot in head
    assert first_doc[0] != eot
