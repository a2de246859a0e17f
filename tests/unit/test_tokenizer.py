import pytest
from conftest import char_tokenizer, gpt2_ranks, make_ranks_file

from mingpt.model.tokenizer import GPT2_RANKS_SHA256, BPETokenizer, TokenizerError, build_bpe, encoding_from_ranks, from_state


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
    tok = build_bpe(gpt2_ranks())
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
