"""The path of the data: sources (reading raw corpora by format) -> prepare (tokenized once, in
parallel, into shards) -> prepared (the dataset reader: memory-mapped or cached shards) -> datasets
(blocks or document pieces) -> samplers (the resumable global-batch plans)."""

from mingpt.data.sources import DataError

__all__ = ["Corpus", "DataError", "build_samplers", "load_corpus"]


def __getattr__(name: str):
    # imported when asked for: a preparation worker needs neither torch nor the datasets
    if name in ("Corpus", "build_samplers", "load_corpus"):
        from mingpt.data import corpus

        return getattr(corpus, name)
    raise AttributeError(name)
