"""A corpus put together (mingpt/data/corpus.py, load_corpus): raw text prepared once and found again,
split into training and validation, and the errors a bad corpus gives."""

import json

import numpy as np
import pytest
from conftest import gpt2_ranks, load_documents, read_corpus

from mingpt.config.schema import DataConfig, TokenizerConfig
from mingpt.data import DataError, load_corpus
from mingpt.data.datasets import StreamDataset


def data_config(path, kind="char", cache="cache", block_size=32, **kw) -> DataConfig:
    ranks = gpt2_ranks() if kind == "bpe" else None
    return DataConfig(path=str(path), fetch_default=False, block_size=block_size, cache_dir=str(cache),
                      tokenizer=TokenizerConfig(kind, ranks), **kw)


def test_a_raw_corpus_is_prepared_with_bpe_from_the_ranks_file_alone(corpus_file, tmp_path, monkeypatch):
    """Offline (a node with no route out): data.tokenizer.ranks_file is the only source, for the
    process that prepares the corpus too (before, its tokenizing worker went to the network)."""
    import tiktoken

    import mingpt.model.tokenizer

    def offline(*_a, **_k):
        raise ConnectionError("no network on this node")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(mingpt.model.tokenizer, "_ranks_from_registry", offline)
    c = load_corpus(data_config(corpus_file, kind="bpe", cache=tmp_path / "cache"))
    assert c.tokenizer.vocab_size == 50257
    assert corpus_file.read_text().startswith(c.tokenizer.decode(all_tokens(c.train)[:20]))


def all_tokens(split: StreamDataset) -> list[int]:
    return split.tokens.read(split.begin, split.end).tolist()


def test_a_one_text_corpus_splits_at_the_last_tenth_of_its_tokens(corpus_file, tmp_path):
    c = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))
    text = corpus_file.read_text()
    total = len(text)  # one token per character, no end-of-text in a char stream
    assert c.train.begin == 0 and c.train.end == c.val.begin == total - int(total * 0.1) and c.val.end == total
    assert c.tokenizer.decode(all_tokens(c.train) + all_tokens(c.val)) == text
    again = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))  # the same for every process
    assert (again.train.end, again.val.begin) == (c.train.end, c.val.begin)


def test_a_raw_corpus_is_prepared_once(corpus_file, tmp_path, monkeypatch):
    import mingpt.data.corpus as corpus

    calls = []
    real = corpus.prepare
    monkeypatch.setattr(corpus, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))
    second = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))
    assert len(calls) == 1 and all_tokens(first.train) == all_tokens(second.train)


def test_a_resume_finds_the_copy_its_first_start_prepared(corpus_file, tmp_path, monkeypatch):
    """A resume knows the tokenizer (from the snapshot) where the first start took it from the text:
    it used to prepare the corpus a second time into a second cache folder."""
    import mingpt.data.corpus as corpus

    calls = []
    real = corpus.prepare
    monkeypatch.setattr(corpus, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))
    resumed = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"), first.tokenizer.state_dict())
    assert len(calls) == 1 and all_tokens(first.train) == all_tokens(resumed.train)
    assert len(list((tmp_path / "cache").glob("prepared-*"))) == 1


def test_load_corpus_end_to_end(corpus_file, tmp_path):
    c = load_corpus(data_config(corpus_file, cache=tmp_path / "cache"))
    assert c.tokenizer.vocab_size < 60
    assert len(c.train) > 9 * len(c.val) - 10


def test_bad_corpora_give_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(str(tmp_path / "nope.txt"), fetch_default=True)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8.*iconv -f latin1 "):
        read_corpus(str(latin), fetch_default=False)
    # the conversion suggested is of the file's encoding: a byte-order mark, or the NULs of UTF-16 without one
    for encoding, name in (("utf-16", "UTF-16"), ("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE"),
                           ("utf-32", "UTF-32")):
        wide = tmp_path / f"{encoding}.txt"
        wide.write_bytes("café au lait\n".encode(encoding) * 10)
        with pytest.raises(DataError, match=f"{wide.name} is not UTF-8 .*`iconv -f {name} -t utf-8 {wide.name} "):
            load_corpus(data_config(str(wide), cache=tmp_path / "cache"))
    # a split too short for one block is named, with what to change
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 30)  # 300 tokens: 270 to train, 30 to validate
    with pytest.raises(DataError, match=r"^the validation split holds 30 tokens, fewer than one block of "
                                        r"data.block_size \+ 1 = 33; .* or a larger data.val_fraction$"):
        load_corpus(data_config(str(short), cache=tmp_path / "cache"))
    with pytest.raises(DataError, match=r"^the training split holds 270 tokens, fewer than one block of "
                                        r"data.block_size \+ 1 = 301; use a larger corpus, a smaller data.block_size$"):
        load_corpus(data_config(str(short), cache=tmp_path / "cache", block_size=300))


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_corpus_tokenized_before_is_found_without_reading_it(corpus_file, tmp_path, monkeypatch, kind):
    cache = tmp_path / "cache"
    first = load_corpus(data_config(corpus_file, kind, cache))

    def no_reading(*args, **kwargs):
        raise AssertionError("the corpus was read again")

    monkeypatch.setattr("mingpt.data.corpus.prepare", no_reading)
    monkeypatch.setattr("mingpt.data.sources.unit_documents", no_reading)
    again = load_corpus(data_config(corpus_file, kind, cache))
    assert again.tokenizer.state_dict() == first.tokenizer.state_dict()
    assert all_tokens(again.train) == all_tokens(first.train) and all_tokens(again.val) == all_tokens(first.val)
    # a snapshot's char vocabulary is another tokenizer: its tokens are found the same way
    if kind == "char":
        state = first.tokenizer.state_dict()
        monkeypatch.undo()
        load_corpus(data_config(corpus_file, kind, cache), tokenizer_state=state)
        monkeypatch.setattr("mingpt.data.corpus.prepare", no_reading)
        load_corpus(data_config(corpus_file, kind, cache), tokenizer_state=state)


def test_a_changed_corpus_is_tokenized_again(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    first = load_corpus(data_config(corpus_file, cache=cache))
    with open(corpus_file, "a", encoding="utf-8") as fh:
        fh.write("Zounds \u00a7~^\n")
    second = load_corpus(data_config(corpus_file, cache=cache))
    assert second.tokenizer.vocab_size > first.tokenizer.vocab_size
    assert second.val.end > first.val.end
    assert second.tokenizer.decode(all_tokens(second.val)[-10:]).endswith("\u00a7~^\n")


@pytest.mark.parametrize("fmt", ["text", "jsonl", "files"])
def test_a_document_corpus_tokenized_before_is_found_without_reading_it(tmp_path, monkeypatch, fmt):
    docs = [f"document {i} " + "word " * (i % 17) for i in range(60)]
    if fmt == "text":
        path = tmp_path / "docs.txt"
        path.write_text("\n\n".join(docs))
    elif fmt == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    else:
        path = tmp_path / "dir"
        path.mkdir()
        for i, d in enumerate(docs):
            (path / f"{i:03d}.txt").write_text(d)
    cache = str(tmp_path / "cache")

    def load():
        return load_documents(path, fmt, cache)

    first = load()
    monkeypatch.setattr("mingpt.data.corpus.prepare", lambda *a, **k: pytest.fail("read again"))
    monkeypatch.setattr("mingpt.data.sources.unit_documents", lambda *a, **k: pytest.fail("read again"))
    again = load()
    assert again.tokenizer.state_dict() == first.tokenizer.state_dict()
    assert np.array_equal(again.train.starts, first.train.starts)
    assert np.array_equal(again.val.lengths, first.val.lengths)
    monkeypatch.undo()
    # a changed document (here: the last one grows) is read and tokenized again
    changed = path / "059.txt" if fmt == "files" else path
    with open(changed, "a") as fh:
        fh.write(" appended" if fmt != "jsonl" else "\n" + json.dumps({"text": "one more document"}))
    total = lambda c: int(c.train.lengths.sum() + c.val.lengths.sum())  # noqa: E731
    assert total(load()) > total(first)
