import math

import numpy as np
import pytest
import torch

from mingpt.data import DataError
from mingpt.data.samplers import StreamSampler, split_evenly
from mingpt.model import GPT, GPTConfig
from mingpt.training.optim import lr_at, param_groups


def rank_shares(indices, world, micro):
    plan = split_evenly(len(indices), world, micro)
    return [[indices[s:e] for s, e in plan[r]] for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_sample_exactly_once_per_epoch(world):
    n, batch = 103, 8
    sampler = StreamSampler(n, batch, seed=5)
    seen = []
    for _ in range(sampler.steps_per_epoch):
        for mbs in rank_shares(sampler.next_batch(), world, micro=2):
            for mb in mbs:
                seen.extend(mb.tolist())
    assert sorted(seen) == list(range(n))
    assert sampler.epoch == 0
    nxt = sampler.next_batch()
    assert sampler.epoch == 1 and len(nxt) == batch


def test_same_plan_for_same_seed_and_new_order_next_epoch():
    a, b = StreamSampler(50, 10, 1), StreamSampler(50, 10, 1)
    first = [a.next_batch() for _ in range(5)]
    assert all(np.array_equal(x, b.next_batch()) for x in first)
    second = np.concatenate([a.next_batch() for _ in range(5)])
    assert not np.array_equal(np.concatenate(first), second)
    assert sorted(second.tolist()) == list(range(50))


def test_resume_mid_epoch_continues_identically():
    ref = StreamSampler(1000, 16, 7)
    run = StreamSampler(1000, 16, 7)
    for _ in range(40):
        ref.next_batch()
        run.next_batch()
    state = run.state_dict()
    fresh = StreamSampler(1000, 16, 7)
    fresh.load_state_dict(state)
    for _ in range(80):  # crosses into the next epoch
        assert np.array_equal(ref.next_batch(), fresh.next_batch())
    with pytest.raises(DataError, match="corpus, block size or seed changed since the snapshot.*trainer.run_dir"):
        StreamSampler(999, 16, 7).load_state_dict(state)


@pytest.mark.parametrize("n, world, micro, accum", [(12, 1, 12, 1), (24, 2, 6, 2), (7, 3, 2, 2), (5, 2, 4, 1),
                                                     (1, 3, 4, 1)])
def test_split_gives_every_rank_the_same_number_of_micro_batches(n, world, micro, accum):
    plan = split_evenly(n, world, micro)
    assert len(plan) == world
    assert all(len(p) == accum for p in plan)
    sizes = [e - s for p in plan for s, e in p]
    assert sum(sizes) == n and max(sizes) <= micro
    per_rank = [sum(e - s for s, e in p) for p in plan]
    assert max(per_rank) - min(per_rank) <= 1


# expected factors of lr=1.0, min_lr=0.1, warmup 10, max 110 (torchtitan-style table)
@pytest.mark.parametrize("step, expected", [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (60, 0.55), (110, 0.1),
                                            (500, 0.1)])
def test_lr_schedule(step, expected):
    assert math.isclose(lr_at(step, 1.0, 0.1, 10, 110), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_decay_only_on_2d_weights():
    model = GPT(GPTConfig(preset="gpt-nano", vocab_size=20, block_size=8))
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())  # the tied weight counted once
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert isinstance(torch.optim.AdamW([decay, no_decay]), torch.optim.AdamW)


def test_epoch_order_in_int32_is_the_order_of_earlier_versions():
    """Snapshots keep a position in the epoch's order: the compact order must be the same one
    that `permutation` (int64) gave."""
    from mingpt.data.samplers import epoch_order

    for n, seed, epoch in [(1, 0, 0), (977, 5, 2), (1_000_003, 1337, 7)]:
        order = epoch_order(n, seed, epoch)
        assert order.dtype == np.int32
        assert np.array_equal(order, np.random.default_rng([seed, epoch]).permutation(n))
