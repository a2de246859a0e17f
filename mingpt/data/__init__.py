"""The path of the data: sources (reading corpora) -> cache (token ids, once per node) -> datasets
(blocks or document pieces) -> samplers (the resumable global-batch plans)."""

from mingpt.data.corpus import Corpus, load_corpus, load_documents
from mingpt.data.sources import DataError

__all__ = ["Corpus", "DataError", "load_corpus", "load_documents"]
