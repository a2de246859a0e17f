"""The distributed, resumable sampler: an order of global batches, independent of the world size.

Each epoch's order is a permutation drawn from (seed, epoch) alone. The position is kept in
global units (samples consumed in the epoch), so a resume with another world size continues
the same sequence of global batches and every sample is seen exactly once per epoch.
"""

from __future__ import annotations

import logging

import numpy as np

from mingpt.data.sources import DataError

log = logging.getLogger(__name__)

def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch, a function of (seed, epoch) only. Shuffled in int32 where the
    count fits: the same order as `permutation(num_samples)` (the same draws), in half the memory."""
    order = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def split_evenly(n: int, world_size: int, micro_batch_size: int) -> list[list[tuple[int, int]]]:
    """How a global batch of n samples is spread over ranks and accumulation steps.

    Returns, for every rank, the (start, end) slices of its micro-batches in the global batch.
    Every rank gets the same number of micro-batches (some may be empty when n does not divide
    evenly, e.g. at the tail of an epoch or after the world size changed); the trainer weights
    each token by 1 / (global token count), so the gradient does not depend on the split.
    """
    per_rank = -(-n // world_size)  # ceil
    accum = max(1, -(-per_rank // micro_batch_size))
    by_rank, start = [], 0
    base, extra = divmod(n, world_size)
    for r in range(world_size):
        count = base + (r < extra)
        mb_base, mb_extra = divmod(count, accum)
        slices = []
        for a in range(accum):
            size = mb_base + (a < mb_extra)
            slices.append((start, start + size))
            start += size
        by_rank.append(slices)
    return by_rank


def validation_batches(sampler: StreamSampler | LengthGroupedSampler, world_size: int,
                       rank: int, eval_iters: int) -> list[np.ndarray]:
    """This rank's micro-batches of the fixed validation subset: `eval_iters` global batches of
    the validation split, planned like training batches, the same at every evaluation.

    `sampler` is a sampler over the validation split (never advanced: only its first epoch's batches are used).
    """
    if isinstance(sampler, StreamSampler):
        n = min(sampler.num_samples, eval_iters * sampler.global_batch)
        indices = np.sort(epoch_order(sampler.num_samples, sampler.seed, 0)[:n])
        mine = np.array_split(indices, world_size)[rank]
        return [mine[i : i + sampler.micro_batch_size] for i in range(0, len(mine), sampler.micro_batch_size)]
    steps = sampler.batches_of(0)
    micro_batches = [mb for i in range(min(eval_iters, len(steps))) for mb in steps[i]]
    return [mb for mb in sampler.split(micro_batches, world_size)[rank] if len(mb)]


def _check_same_order(state: dict, num_samples: int, seed: int) -> None:
    """A saved position only means something for the same samples and seed."""
    if state["num_samples"] != num_samples or state["seed"] != seed:
        raise DataError(
            f"the snapshot's data order ({state['num_samples']} samples, seed {state['seed']}) does not match "
            f"this run's ({num_samples} samples, seed {seed}): the corpus, block size or seed changed since the "
            "snapshot. Resume with the snapshot's data settings, or start a new run in its own directory: "
            "trainer.run_dir=runs/NEW"
        )


class StreamSampler:
    """Global batches of fixed-length blocks over epochs; Stateful.

    Like every sampler here: `next_step()` gives the micro-batches of the next global step (the
    same whatever the world size) and `split(micro_batches, world_size)` every rank's part of it.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, micro_batch_size: int | None = None):
        if num_samples <= 0:
            raise ValueError("the dataset has no samples")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch_size = micro_batch_size or global_batch
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

    def next_step(self) -> list[np.ndarray]:
        return [self.next_batch()]

    def split(self, micro_batches: list[np.ndarray], world_size: int) -> list[list[np.ndarray]]:
        """Every rank's micro-batches of a global step."""
        batch = np.concatenate(micro_batches)
        by_rank = split_evenly(len(batch), world_size, self.micro_batch_size)
        return [[batch[a:b] for a, b in slices] for slices in by_rank]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        _check_same_order(state, self.num_samples, self.seed)
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def micro_batch_bounds(order: np.ndarray, lengths: np.ndarray, token_budget: int) -> np.ndarray:
    """Cut `order` into consecutive micro-batches whose padded size B x T_max stays within the budget.

    Greedy: a piece joins the current micro-batch unless (pieces + 1) x the longest would exceed the
    budget. Returns the M+1 boundaries in `order` of the M micro-batches. `lengths` are sequence
    lengths in tokens (inputs, i.e. piece length - 1).

    One Python iteration per micro-batch, not per piece: inside a non-increasing run of lengths the
    first piece of a batch is its longest, so the batch's end is known at once; only a run boundary
    (the start of the next length-sorted pool) can raise the maximum.
    """
    n = len(order)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    t = lengths[order]
    rises = _compact(np.flatnonzero(t[1:] > t[:-1]) + 1)  # where a non-increasing run starts (after the first)
    is_rise = np.zeros(n, dtype=bool)
    is_rise[rises] = True
    run_end = np.append(rises, n)[np.cumsum(is_rise, dtype=rises.dtype)]  # the end of the run each position is in
    del is_rise
    bounds, start = [0], 0
    while start < n:
        t_max, pos = int(t[start]), start
        while True:
            end = min(start + max(1, token_budget // t_max), int(run_end[pos]))
            if end == n or end < run_end[pos]:
                break  # the budget (or the data) ends the batch inside this run
            t_next = int(t[end])  # the first piece of the next run may be longer
            if (end - start + 1) * max(t_max, t_next) > token_budget:
                break
            t_max, pos = max(t_max, t_next), end
        bounds.append(end)
        start = end
    return np.asarray(bounds, dtype=np.int64)


def _compact(indices: np.ndarray) -> np.ndarray:
    """Indices in 32 bits where they fit: half the memory of numpy's default."""
    return indices.astype(np.int32) if len(indices) < 2**31 else indices


def _small_uint(values: np.ndarray) -> np.ndarray:
    """Non-negative ints in 16 bits where they fit: numpy sorts those stably by radix, in O(n)."""
    return values.astype(np.uint16) if values.max(initial=0) < 2**16 else values


def longest_first_within_pools(order: np.ndarray, lengths: np.ndarray, pool_size: int) -> np.ndarray:
    """Sort each pool of `pool_size` consecutive entries of `order` by length, longest first, ties
    in their order. Two stable sorts (by length, then by pool) instead of one per pool."""
    t = lengths[order]
    key = _small_uint(t.max(initial=0) - t)
    del t  # temporaries go as soon as they are used: this runs on 10^7 pieces
    by_length = _compact(np.argsort(key, kind="stable"))
    del key
    pool = _small_uint(by_length // pool_size)
    by_pool = np.argsort(pool, kind="stable")
    del pool
    by_length = by_length[by_pool]
    del by_pool
    return order[by_length]


class EpochBatches:
    """One epoch of global steps in three compact arrays: the piece order, the micro-batch
    boundaries in it, and the (shuffled) order of the steps, each `micro_per_step` consecutive
    micro-batches. A step's micro-batches are views, made when asked for."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, step_order: np.ndarray, micro_per_step: int):
        self.order, self.bounds, self.step_order, self.micro_per_step = order, bounds, step_order, micro_per_step

    def __len__(self) -> int:
        return len(self.step_order)

    def __getitem__(self, i: int) -> list[np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        first = int(self.step_order[i]) * self.micro_per_step
        last = min(first + self.micro_per_step, len(self.bounds) - 1)
        return [self.order[self.bounds[j] : self.bounds[j + 1]] for j in range(first, last)]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def split_balanced(costs: list[float], world_size: int) -> list[list[int]]:
    """Spread items over ranks: the same count on every rank (ceil), loads as equal as possible.

    Longest-processing-time first, restricted to ranks that still have room.
    """
    per_rank = -(-len(costs) // world_size)
    loads, assigned = [0.0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        r = min((r for r in range(world_size) if len(assigned[r]) < per_rank), key=lambda r: loads[r])
        assigned[r].append(i)
        loads[r] += costs[i]
    return assigned


class LengthGroupedSampler:
    """Token-budget micro-batches of variable-length pieces, planned per epoch from (seed, epoch)
    (the plan, and `random`, the baseline: docs/data.md). Stateful, in global units.

    Other batching settings at a resume cut the epoch otherwise, so the snapshot's steps stay done
    and the rest of the epoch is planned anew over the pieces they left (`earlier`): a run that must
    lower its token budget (a smaller GPU) can go on. It costs a replay of the earlier plans.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, micro_per_step: int, seed: int,
                 mode: str = "length_grouped", pool_size: int = 4096, attn_coeff: float = 0.0):
        if mode not in ("length_grouped", "random"):
            raise ValueError(f"batching mode {mode!r}: use length_grouped or random")
        if len(lengths) == 0:
            raise ValueError("the dataset has no pieces")
        if token_budget < int(lengths.max()):
            raise ValueError(f"token budget {token_budget} is below the longest sequence ({int(lengths.max())})")
        lengths = np.asarray(lengths)
        self.lengths = lengths.astype(np.int32 if lengths.max() < 2**31 else np.int64, copy=False)
        self.token_budget, self.micro_per_step, self.seed = token_budget, micro_per_step, seed
        self.mode, self.pool_size, self.attn_coeff = mode, pool_size, attn_coeff
        self.num_samples = len(lengths)
        self.epoch, self.step_in_epoch = 0, 0
        self.earlier: list[dict] = []  # this epoch's steps done under other settings: {"settings", "steps"}
        self._batches: EpochBatches | None = None
        self._batches_epoch = -1

    @property
    def settings(self) -> dict:
        """What cuts an epoch into steps (the world size and attn_coeff only split a step)."""
        return {"mode": self.mode, "token_budget": self.token_budget, "micro_per_step": self.micro_per_step,
                "pool_size": self.pool_size}

    def batches_of(self, epoch: int, settings: dict | None = None, done: np.ndarray | None = None) -> EpochBatches:
        """The epoch's global steps, each a list of micro-batches of piece indices: under `settings`
        (this sampler's by default), over the pieces not `done` (a mask; all by default). Vectorised
        but for one loop per micro-batch: seconds for 10^7 pieces."""
        s = settings or self.settings
        rng = np.random.default_rng([self.seed, epoch])
        order = _compact(rng.permutation(self.num_samples))  # 40 MB per 10^7 pieces
        if done is not None:
            order = order[~done[order]]
        if s["mode"] == "length_grouped":
            order = longest_first_within_pools(order, self.lengths, s["pool_size"])
            bounds = micro_batch_bounds(order, self.lengths, s["token_budget"])
        else:
            per_batch = max(1, s["token_budget"] // max(1, int(self.lengths.mean())))
            bounds = np.append(np.arange(0, len(order), per_batch), len(order))
        num_steps = -(-(len(bounds) - 1) // s["micro_per_step"])
        return EpochBatches(order, bounds, rng.permutation(num_steps), s["micro_per_step"])

    @property
    def steps_per_epoch(self) -> int:
        return len(self._epoch_batches())

    def _epoch_batches(self) -> EpochBatches:
        if self._batches_epoch != self.epoch:
            done = np.zeros(self.num_samples, dtype=bool) if self.earlier else None
            for part in self.earlier:  # each plan covers the pieces the ones before it left
                plan = self.batches_of(self.epoch, part["settings"], done)
                for i in range(part["steps"]):
                    for mb in plan[i]:
                        done[mb] = True
            self._batches, self._batches_epoch = self.batches_of(self.epoch, done=done), self.epoch
        return self._batches

    def next_step(self) -> list[np.ndarray]:
        if self.step_in_epoch >= len(self._epoch_batches()):
            self.epoch, self.step_in_epoch, self.earlier = self.epoch + 1, 0, []
        step = self._epoch_batches()[self.step_in_epoch]
        self.step_in_epoch += 1
        return step

    def cost(self, mb: np.ndarray) -> float:
        """Estimated FLOPs of a micro-batch, in units of 6N per token: B*T*(1 + c*T) for attention."""
        if len(mb) == 0:
            return 0.0
        t = float(self.lengths[mb].max())
        return len(mb) * t * (1.0 + self.attn_coeff * t)

    def split(self, micro_batches: list[np.ndarray], world_size: int) -> list[list[np.ndarray]]:
        """Every rank's micro-batches: the same number on each (empty ones fill up), loads balanced
        by estimated FLOPs."""
        per_rank = -(-len(micro_batches) // world_size)
        if self.mode == "random":
            groups = [list(range(r, len(micro_batches), world_size)) for r in range(world_size)]
        else:
            groups = split_balanced([self.cost(mb) for mb in micro_batches], world_size)
        out = []
        for idx in groups:
            mine = [micro_batches[i] for i in idx]
            out.append(mine + [np.empty(0, dtype=np.int64)] * (per_rank - len(mine)))
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.step_in_epoch, "seed": self.seed, "num_samples": self.num_samples,
                "settings": self.settings, "earlier": self.earlier}

    def load_state_dict(self, state: dict) -> None:
        _check_same_order(state, self.num_samples, self.seed)
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["offset"])
        self.earlier = list(state.get("earlier", []))
        saved = state.get("settings", self.settings)  # snapshots of earlier versions did not say
        if saved != self.settings and self.step_in_epoch:
            changed = ", ".join(f"{k} {saved[k]} -> {v}" for k, v in self.settings.items() if saved[k] != v)
            log.info("batching changed since the snapshot (%s): the rest of epoch %d is planned anew over the "
                     "pieces its %d steps left", changed, self.epoch, self.step_in_epoch)
            self.earlier.append({"settings": saved, "steps": self.step_in_epoch})
            self.step_in_epoch = 0
        self._batches_epoch = -1  # the plan of this epoch may differ from the one made before the load
