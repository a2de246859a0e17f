"""Tokenizing a raw corpus in chunks (mingpt/data/encode.py)."""

import numpy as np
import pytest
from conftest import char_tokenizer, gpt2_ranks

from mingpt.data.encode import encode_array, safe_cuts
from mingpt.model.tokenizer import build_bpe


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_chunked_encoding_gives_the_tokens_of_one_encode(kind):
    """The chunks are cut only where GPT-2's pre-tokenizer cannot join across: tricky whitespace
    (runs of newlines and spaces, tabs, a space before a newline, contractions at a line start)."""
    rng = np.random.default_rng(0)
    pieces = ["word", " word", "\n", "\n\n", "  \n", " \n", "\t", "'s", "'ll", "42", " 7", "é", "中文", "!", "  ",
              "\r\n", " \n\n"]
    text = "".join(pieces[i] for i in rng.integers(0, len(pieces), 20000))
    tok = build_bpe(gpt2_ranks()) if kind == "bpe" else char_tokenizer(text)
    cuts = safe_cuts(text, chunk_chars=50)
    assert len(cuts) > 100  # many chunks, so that many cuts are exercised
    for a in cuts[1:-1]:
        assert text[a - 1] == "\n" and not text[a - 2].isspace() and not text[a].isspace()
    assert encode_array(text, tok, chunk_chars=50).tolist() == tok.encode(text)
