"""The distributed, resumable sampler: a plan of global batches, independent of the world size.

Each epoch's order is a permutation drawn from (seed, epoch) alone. The position is kept in
global units (samples consumed in the epoch), so a resume with another world size continues
the same sequence of global batches and every sample is seen exactly once per epoch.
"""

from __future__ import annotations

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch, a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def split_global_batch(n: int, world_size: int, micro_batch_size: int) -> list[list[tuple[int, int]]]:
    """How a global batch of n samples is spread over ranks and accumulation steps.

    Returns, for every rank, the (start, end) slices of its micro-batches in the global batch.
    Every rank gets the same number of micro-batches (some may be empty when n does not divide
    evenly, e.g. at the tail of an epoch or after the world size changed); the trainer weights
    each token by 1 / (global token count), so the gradient does not depend on the split.
    """
    per_rank = -(-n // world_size)  # ceil
    accum = max(1, -(-per_rank // micro_batch_size))
    plan, start = [], 0
    base, extra = divmod(n, world_size)
    for r in range(world_size):
        count = base + (r < extra)
        mb_base, mb_extra = divmod(count, accum)
        slices = []
        for a in range(accum):
            size = mb_base + (a < mb_extra)
            slices.append((start, start + size))
            start += size
        plan.append(slices)
    return plan


class StreamSampler:
    """Global batches of sample indices over epochs; Stateful."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if num_samples <= 0:
            raise ValueError("the dataset has no samples")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # samples of the current epoch already handed out (global units)
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = epoch_order(self.num_samples, self.seed, self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> np.ndarray:
        """The next global batch (the last of an epoch may be shorter); advances the position."""
        if self.offset >= self.num_samples:
            self.epoch += 1
            self.offset = 0
        order = self._current_order()
        batch = order[self.offset : self.offset + self.global_batch]
        self.offset += len(batch)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"the snapshot's data plan ({state['num_samples']} samples, seed {state['seed']}) does not match "
                f"this run's ({self.num_samples} samples, seed {self.seed}): the corpus, block size or seed changed"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
