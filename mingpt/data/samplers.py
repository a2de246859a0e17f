"""The distributed, resumable sampler: a plan of global batches, independent of the world size.

Each epoch's order is a permutation drawn from (seed, epoch) alone. The position is kept in
global units (samples consumed in the epoch), so a resume with another world size continues
the same sequence of global batches and every sample is seen exactly once per epoch.
"""

from __future__ import annotations

import numpy as np

from mingpt.data.sources import DataError


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch, a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def split_evenly(n: int, world_size: int, micro_batch_size: int) -> list[list[tuple[int, int]]]:
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


def validation_batches(sampler: "StreamSampler | LengthGroupedSampler", world_size: int,
                       rank: int, eval_iters: int) -> list[np.ndarray]:
    """This rank's micro-batches of the fixed validation subset: `eval_iters` global batches of
    the validation split, planned like training batches, the same at every evaluation.

    `sampler` is a sampler over the validation split (never advanced: only its plan is used).
    """
    if isinstance(sampler, StreamSampler):
        n = min(sampler.num_samples, eval_iters * sampler.global_batch)
        indices = np.sort(epoch_order(sampler.num_samples, sampler.seed, 0)[:n])
        mine = np.array_split(indices, world_size)[rank]
        return [mine[i : i + sampler.micro_batch_size] for i in range(0, len(mine), sampler.micro_batch_size)]
    micro_batches = [mb for step in sampler.plan(0)[:eval_iters] for mb in step]
    return [mb for mb in sampler.split(micro_batches, world_size)[rank] if len(mb)]


def _check_same_plan(state: dict, num_samples: int, seed: int) -> None:
    """A saved position only means something for the same samples and seed."""
    if state["num_samples"] != num_samples or state["seed"] != seed:
        raise DataError(
            f"the snapshot's data plan ({state['num_samples']} samples, seed {state['seed']}) does not match "
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
        plan = split_evenly(len(batch), world_size, self.micro_batch_size)
        return [[batch[a:b] for a, b in slices] for slices in plan]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        _check_same_plan(state, self.num_samples, self.seed)
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def form_micro_batches(order: np.ndarray, lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Cut `order` into consecutive micro-batches whose padded size B x T_max stays within the budget.

    `lengths` are sequence lengths in tokens (inputs, i.e. piece length - 1). Sorted input gives
    many short sequences to a batch and few long ones.
    """
    batches, start, t_max = [], 0, 0
    for i, idx in enumerate(order):
        t = int(lengths[idx])
        if i > start and (i - start + 1) * max(t_max, t) > token_budget:
            batches.append(order[start:i])
            start, t_max = i, 0
        t_max = max(t_max, t)
    if start < len(order):
        batches.append(order[start:])
    return batches


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
    """Token-budget micro-batches of variable-length pieces, planned per epoch from (seed, epoch).

    length_grouped: shuffle, sort by length within pools of `pool_size` pieces, cut micro-batches
    under the token budget, group `micro_per_step` consecutive (similar) micro-batches into a global
    step, shuffle the steps, and give each rank micro-batches of equal estimated FLOPs.
    random (the usual baseline, for comparison): a fixed number of random pieces per micro-batch,
    chosen so that a micro-batch holds as many real tokens on average as the budget, handed to
    ranks round-robin. The plan does not depend on the world size; the position (epoch, steps
    done) is in global units. Stateful.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, micro_per_step: int, seed: int,
                 mode: str = "length_grouped", pool_size: int = 4096, attn_coeff: float = 0.0):
        if mode not in ("length_grouped", "random"):
            raise ValueError(f"batching mode {mode!r}: use length_grouped or random")
        if len(lengths) == 0:
            raise ValueError("the dataset has no pieces")
        if token_budget < int(lengths.max()):
            raise ValueError(f"token budget {token_budget} is below the longest sequence ({int(lengths.max())})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_budget, self.micro_per_step, self.seed = token_budget, micro_per_step, seed
        self.mode, self.pool_size, self.attn_coeff = mode, pool_size, attn_coeff
        self.num_samples = len(lengths)
        self.epoch, self.step_in_epoch = 0, 0
        self._plan: list[list[np.ndarray]] | None = None
        self._plan_epoch = -1

    def plan(self, epoch: int) -> list[list[np.ndarray]]:
        """The epoch's global steps, each a list of micro-batches of piece indices."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_samples)
        if self.mode == "length_grouped":
            pools = [order[i : i + self.pool_size] for i in range(0, len(order), self.pool_size)]
            order = np.concatenate([p[np.argsort(-self.lengths[p], kind="stable")] for p in pools])
        if self.mode == "length_grouped":
            micro = form_micro_batches(order, self.lengths, self.token_budget)
        else:
            per_batch = max(1, self.token_budget // max(1, int(self.lengths.mean())))
            micro = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
        steps = [micro[i : i + self.micro_per_step] for i in range(0, len(micro), self.micro_per_step)]
        return [steps[i] for i in rng.permutation(len(steps))]

    @property
    def steps_per_epoch(self) -> int:
        return len(self._current_plan())

    def _current_plan(self) -> list[list[np.ndarray]]:
        if self._plan_epoch != self.epoch:
            self._plan, self._plan_epoch = self.plan(self.epoch), self.epoch
        return self._plan

    def next_step(self) -> list[np.ndarray]:
        if self.step_in_epoch >= len(self._current_plan()):
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        step = self._current_plan()[self.step_in_epoch]
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
        return {"epoch": self.epoch, "offset": self.step_in_epoch, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        _check_same_plan(state, self.num_samples, self.seed)
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["offset"])
