"""The samplers (mingpt/data/samplers.py): every sample or piece once per epoch, the same plan for the
same seed, resumes mid-epoch, micro-batches balanced across ranks."""

import copy
import logging

import numpy as np
import pytest

from mingpt.data import DataError
from mingpt.data.samplers import LengthGroupedSampler, StreamSampler, micro_batch_bounds, split_balanced, split_evenly


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


def test_epoch_order_in_int32_is_the_order_of_earlier_versions():
    """Snapshots keep a position in the epoch's order: the compact order must be the same one
    that `permutation` (int64) gave."""
    from mingpt.data.samplers import epoch_order

    for n, seed, epoch in [(1, 0, 0), (977, 5, 2), (1_000_003, 1337, 7)]:
        order = epoch_order(n, seed, epoch)
        assert order.dtype == np.int32
        assert np.array_equal(order, np.random.default_rng([seed, epoch]).permutation(n))


def skewed_lengths(n=3000, seed=0, block=256):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.4, 1.0, n).astype(np.int64), 3, block)


def all_pieces(sampler, world, steps):
    seen = []
    for _ in range(steps):
        for mbs in sampler.split(sampler.next_step(), world):
            for mb in mbs:
                seen.extend(mb.tolist())
    return seen


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", ["length_grouped", "random"])
def test_every_piece_exactly_once_per_epoch_and_equal_micro_batch_counts(world, mode):
    lengths = skewed_lengths()
    s = LengthGroupedSampler(lengths, token_budget=1024, micro_per_step=4, seed=3, mode=mode)
    seen = []
    for _ in range(s.steps_per_epoch):
        per_rank = s.split(s.next_step(), world)
        assert len({len(mbs) for mbs in per_rank}) == 1  # the same number of micro-batches on every rank
        for mbs in per_rank:
            for mb in mbs:
                if mode == "length_grouped":
                    assert len(mb) == 0 or len(mb) * lengths[mb].max() <= 1024  # the token budget
                seen.extend(mb.tolist())
    assert sorted(seen) == list(range(len(lengths)))


def test_same_plan_for_same_seed_and_epoch_different_next_epoch():
    lengths = skewed_lengths()
    a = LengthGroupedSampler(lengths, 1024, 4, seed=1)
    b = LengthGroupedSampler(lengths, 1024, 4, seed=1)
    p0, p1 = a.batches_of(0), b.batches_of(0)
    assert all(np.array_equal(x, y) for sa, sb in zip(p0, p1) for x, y in zip(sa, sb))
    flat = lambda plan: np.concatenate([mb for step in plan for mb in step])  # noqa: E731
    assert not np.array_equal(flat(p0), flat(a.batches_of(1)))


def test_resume_mid_epoch_same_and_other_world_size():
    lengths = skewed_lengths()
    ref = LengthGroupedSampler(lengths, 1024, 6, seed=9)
    run = LengthGroupedSampler(lengths, 1024, 6, seed=9)
    first = all_pieces(run, world=2, steps=15)
    all_pieces(ref, world=2, steps=15)
    state = run.state_dict()
    fresh = LengthGroupedSampler(lengths, 1024, 6, seed=9)
    fresh.load_state_dict(state)
    for _ in range(10):
        a, b = ref.next_step(), fresh.next_step()
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # a different world size after the restart: the rest of the epoch, nothing repeated or skipped
    other = LengthGroupedSampler(lengths, 1024, 6, seed=9)
    other.load_state_dict(state)
    rest = all_pieces(other, world=3, steps=other.steps_per_epoch - 15)
    assert sorted(first + rest) == list(range(len(lengths)))


def rest_of_epoch(sampler, world):
    """The pieces of the steps left in the sampler's epoch, and the first step of the next one."""
    epoch, seen = sampler.epoch, []
    while True:
        step = sampler.next_step()
        if sampler.epoch != epoch:
            return seen, step
        seen += [i for mbs in sampler.split(step, world) for mb in mbs for i in mb.tolist()]


@pytest.mark.parametrize("change", [{"token_budget": 2048}, {"token_budget": 512, "micro_per_step": 2},
                                    {"pool_size": 500}, {"mode": "random"}])
def test_a_resume_with_other_batching_settings_trains_every_piece_of_the_epoch_once(change, caplog):
    """Issue 33: a resume with another token budget left 9,886 of 20,000 pieces of the epoch untrained."""
    lengths = skewed_lengths(20000)
    old = {"token_budget": 1024, "micro_per_step": 4, "pool_size": 4096, "mode": "length_grouped", "seed": 5}
    run = LengthGroupedSampler(lengths, **old)
    first = all_pieces(run, world=2, steps=run.steps_per_epoch // 2)
    resumed = LengthGroupedSampler(lengths, **old | change)
    with caplog.at_level(logging.INFO):
        resumed.load_state_dict(run.state_dict())
    assert all(f"{k} {old[k]} -> {v}" in caplog.text for k, v in change.items())  # said, not silent
    rest, _ = rest_of_epoch(copy.deepcopy(resumed), world=3)
    assert len(lengths) - len(set(first + rest)) == 0 and len(first + rest) == len(lengths)  # none skipped, none twice
    mid = all_pieces(resumed, world=3, steps=5)
    # a restart with the new settings continues that plan step for step
    again = LengthGroupedSampler(lengths, **old | change)
    again.load_state_dict(resumed.state_dict())
    for _ in range(5):
        step = again.next_step()
        assert all(np.array_equal(x, y) for x, y in zip(resumed.next_step(), step))
        mid += np.concatenate(step).tolist()
    # and the settings changed back at a third start: still every piece once
    back = LengthGroupedSampler(lengths, **old)
    back.load_state_dict(again.state_dict())
    rest, next_first = rest_of_epoch(back, world=1)
    trained = first + mid + rest
    assert len(lengths) - len(set(trained)) == 0  # never trained
    assert len(trained) == len(lengths)  # nothing twice
    # the next epoch is the whole plan of the settings in force
    assert all(np.array_equal(x, y) for x, y in zip(next_first, LengthGroupedSampler(lengths, **old).batches_of(1)[0]))


def test_balance_on_a_skewed_distribution_and_padding():
    lengths = skewed_lengths(6000)
    grouped = LengthGroupedSampler(lengths, 2048, 8, seed=0, attn_coeff=0.001)
    rnd = LengthGroupedSampler(lengths, 2048, 8, seed=0, mode="random", attn_coeff=0.001)

    def figures(s):
        ratios, padded, real = [], 0, 0
        for _ in range(s.steps_per_epoch - 1):  # the last step of an epoch may be short
            per_rank = s.split(s.next_step(), 2)
            work = [sum(s.cost(mb) for mb in mbs) for mbs in per_rank]
            ratios.append(max(work) / (sum(work) / 2))
            for mbs in per_rank:
                for mb in mbs:
                    if len(mb):
                        padded += len(mb) * lengths[mb].max()
                        real += lengths[mb].sum()
        return float(np.mean(ratios)), 1 - real / padded

    g_ratio, g_pad = figures(grouped)
    r_ratio, r_pad = figures(rnd)
    assert g_ratio <= 1.05 and g_pad < 0.05
    assert r_pad > 0.3  # random batching pads far more


def greedy_micro_batches(order, lengths, token_budget):
    """The specification, one piece at a time: a piece joins the batch unless (pieces + 1) x the
    longest would exceed the budget."""
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


def test_micro_batch_bounds_and_balance_helpers():
    lengths = np.array([10, 10, 5, 5, 5, 20])
    assert micro_batch_bounds(np.arange(6), lengths, token_budget=20).tolist() == [0, 2, 5, 6]
    assert micro_batch_bounds(np.arange(0), lengths, token_budget=20).tolist() == [0]
    assert split_balanced([5, 4, 3, 3, 1, 0], 2) == [[0, 3, 5], [1, 2, 4]]


@pytest.mark.parametrize("seed", range(6))
def test_micro_batch_bounds_equal_the_piece_by_piece_greedy(seed):
    rng = np.random.default_rng(seed)
    lengths = skewed_lengths(2000, seed=seed)
    budget = int(rng.integers(256, 2048))
    pooled = rng.permutation(2000)
    pool = np.arange(2000) // 97
    pooled = pooled[np.lexsort((-lengths[pooled], pool))]  # sorted pools, as the sampler plans
    for order in (pooled, rng.permutation(2000), np.sort(pooled)):  # and any order at all
        bounds = micro_batch_bounds(order, lengths, budget)
        expected = greedy_micro_batches(order, lengths, budget)
        assert [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])] == [b.tolist() for b in expected]


def test_the_plan_is_the_one_earlier_versions_made():
    """Snapshots of earlier versions store a position in this plan: it must not change."""
    lengths = skewed_lengths(5000, seed=4)
    s = LengthGroupedSampler(lengths, token_budget=1024, micro_per_step=3, seed=7, pool_size=300)
    rng = np.random.default_rng([7, 2])
    order = rng.permutation(5000)
    pools = [order[i : i + 300] for i in range(0, 5000, 300)]
    order = np.concatenate([p[np.argsort(-lengths[p], kind="stable")] for p in pools])
    micro = greedy_micro_batches(order, lengths, 1024)
    steps = [micro[i : i + 3] for i in range(0, len(micro), 3)]
    expected = [steps[i] for i in rng.permutation(len(steps))]
    plan = s.batches_of(2)
    assert len(plan) == len(expected)
    assert all([mb.tolist() for mb in a] == [mb.tolist() for mb in b] for a, b in zip(plan, expected))
