"""Datasets over token ids: fixed blocks of one stream, or pieces of documents; the splits."""

from __future__ import annotations

import numpy as np
import torch

from mingpt.data.prepared import TokenStream
from mingpt.data.sources import DataError


class StreamDataset:
    """Classic minGPT blocks of tokens [begin, end) of the stream: sample i is the T + 1 tokens from
    begin + i*T, inputs and shifted targets."""

    def __init__(self, tokens: TokenStream, begin: int, end: int, block_size: int, split: str):
        if end - begin < block_size + 1:
            raise DataError(f"the {split} split holds {end - begin} tokens, fewer than one block of data.block_size + 1 "
                            f"= {block_size + 1}; use a larger corpus, a smaller data.block_size"
                            + (", or a larger data.val_fraction" if split == "validation" else ""))
        self.tokens, self.begin, self.end = tokens, begin, end
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.end - self.begin - 1) // self.block_size

    def tokens_in(self, indices: np.ndarray) -> int:
        """Target tokens that count in a batch of these samples (all of them, for blocks)."""
        return len(indices) * self.block_size

    def batch_stats(self, per_rank: list[list[np.ndarray]]) -> dict:
        """Padding and balance figures of one global step (no padding in fixed blocks)."""
        return _balance_stats([sum(self.tokens_in(mb) for mb in mbs) for mbs in per_rank], 0.0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.begin + np.asarray(indices, dtype=np.int64) * self.block_size  # (B,)
        rows = torch.from_numpy(self.tokens.window(starts, self.block_size + 1))  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)


def _balance_stats(real_per_rank: list[int], pad_frac: float) -> dict:
    mean = sum(real_per_rank) / len(real_per_rank)
    return {"pad_frac": round(pad_frac, 4), "rank_tokens_max_mean": round(max(real_per_rank) / mean, 4) if mean else 1.0}


def split_pieces(doc_starts: np.ndarray, doc_lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into pieces of at most max_len tokens; pieces under 2 tokens (nothing to
    predict) are dropped. Returns (starts, lengths), vectorised over documents."""
    n = -(-doc_lengths // max_len)  # pieces per document
    doc = np.repeat(np.arange(len(doc_lengths)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # piece number within its document
    starts = doc_starts[doc] + k * max_len
    lengths = np.minimum(max_len, doc_lengths[doc] - k * max_len)
    keep = lengths >= 2
    return starts[keep], lengths[keep]


class DocumentDataset:
    """Pieces of documents, at most block_size+1 tokens each, right-padded into batches.

    Padding positions get target -100 (ignored by the loss), so no attention mask is needed:
    causal attention means real tokens never see the padding after them.
    """

    def __init__(self, tokens: TokenStream, starts: np.ndarray, lengths: np.ndarray, block_size: int, pad_id: int):
        if len(starts) == 0:
            raise DataError("a split holds no document pieces of 2 tokens or more")
        self.tokens, self.starts, self.lengths = tokens, starts, lengths
        self.block_size, self.pad_id = block_size, pad_id
        self.seq_lengths = lengths - 1  # input (and target) positions per piece

    def __len__(self) -> int:
        return len(self.starts)

    def tokens_in(self, indices: np.ndarray) -> int:
        return int(self.seq_lengths[np.asarray(indices, dtype=np.int64)].sum())

    def batch_stats(self, per_rank: list[list[np.ndarray]]) -> dict:
        real = [sum(self.tokens_in(mb) for mb in mbs) for mbs in per_rank]
        padded = sum(len(mb) * int(self.seq_lengths[mb].max()) for mbs in per_rank for mb in mbs if len(mb))
        return _balance_stats(real, 1.0 - sum(real) / padded if padded else 0.0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        T = int(self.seq_lengths[indices].max())
        x = np.full((len(indices), T), self.pad_id, dtype=np.int64)  # (B, T)
        y = np.full((len(indices), T), -100, dtype=np.int64)  # (B, T)
        for row, i in enumerate(indices):
            piece = self.tokens.read(int(self.starts[i]), int(self.starts[i] + self.lengths[i])).astype(np.int64)
            x[row, : len(piece) - 1] = piece[:-1]
            y[row, : len(piece) - 1] = piece[1:]
        return torch.from_numpy(x), torch.from_numpy(y)
