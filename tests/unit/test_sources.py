import copy
import json
import logging

import numpy as np
import pytest
from conftest import make_docs_corpus, read_documents

from mingpt.config import DataConfig, DocumentsConfig
from mingpt.data import DataError, load_corpus
from mingpt.data.datasets import split_pieces
from mingpt.data.samplers import LengthGroupedSampler, micro_batch_bounds, split_balanced


def load_documents(path, fmt, cache, block_size=16, val_fraction=0.1):
    return load_corpus(DataConfig(path=str(path), fetch_default=False, block_size=block_size,
                                  val_fraction=val_fraction, cache_dir=str(cache), kind="documents",
                                  documents=DocumentsConfig(format=fmt)))


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


def test_split_pieces():
    starts, lengths = split_pieces(np.array([0, 10, 11]), np.array([10, 1, 25]), max_len=8)
    assert lengths.tolist() == [8, 2, 8, 8, 8]  # the 1-token document and a 1-token tail are dropped
    assert starts.tolist() == [0, 8, 11, 19, 27]


def test_documents_from_text_jsonl_and_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo two\n\n\n\nthree")
    docs = read_documents(str(tmp_path / "a.txt"), "text", "\n\n", "text", False)
    assert docs == ["one", "two two", "three"]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate("xyz")))
    assert read_documents(str(tmp_path / "b.jsonl"), "jsonl", "", "text", False) == ["x", "y", "z"]
    with pytest.raises(DataError, match="data.documents.text_field"):
        read_documents(str(tmp_path / "b.jsonl"), "jsonl", "", "body", False)
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(f"file {i}")
    assert read_documents(str(d), "files", "", "", False) == ["file 0", "file 1", "file 2"]
    assert read_documents(str(d / "*.txt"), "files", "", "", False) == ["file 0", "file 1", "file 2"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a", ', r"line 2 is not valid JSON \(Expecting property name enclosed in double quotes at column 15\); "
                      "fix or remove that line"),
    ('["a", "b"]', r"line 2 is a JSON list, not an object"),
    ('{"body": "a", "id": 3}', r"line 2 has no field 'text' \(its fields: body, id\); set data.documents.text_field"),
    ('{"text": 7}', r"line 2: field 'text' is a int, not a string"),
], ids=["malformed", "not-an-object", "missing-field", "not-a-string"])
def test_each_bad_json_line_is_named_for_what_it_is(tmp_path, line, message):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as e:
        read_documents(str(path), "jsonl", "", "text", False)
    if "no field" not in message:
        assert "text_field" not in str(e.value)  # a broken line is not the field setting's fault


def test_document_dataset_pieces_eot_padding_and_split(tmp_path):
    corpus = make_docs_corpus(tmp_path, n=200)
    c = load_documents(corpus, "text", tmp_path / "cache", block_size=32)
    eot = c.tokenizer.eot_id
    assert eot == c.tokenizer.vocab_size - 1
    assert c.train.lengths.max() <= 33 and c.train.lengths.min() >= 2
    # the validation documents are the last 10%, disjoint from training
    assert c.val.starts.min() > c.train.starts.max()
    idx = np.array([int(np.argmin(c.train.lengths)), int(np.argmax(c.train.lengths))])
    x, y = c.train.batch(idx)
    short = int(c.train.seq_lengths[idx[0]])
    assert x.shape == (2, 32) and (y[0, short:] == -100).all() and (y[0, :short] >= 0).all()
    assert c.train.tokens_in(idx) == short + 32
    head = c.train.tokens.read(0, 200)
    first_doc = head[: c.train.lengths[0]]
    text = c.tokenizer.decode(head.tolist())
    assert "<|endoftext|>" in text and eot in head
    assert first_doc[0] != eot


@pytest.mark.parametrize("fmt", ["text", "jsonl", "files"])
def test_a_document_corpus_tokenized_before_is_found_without_reading_it(tmp_path, monkeypatch, fmt):
    docs = [f"document {i} " + "word " * (i % 17) for i in range(60)]
    if fmt == "text":
        path = tmp_path / "docs.txt"
        path.write_text("\n\n".join(docs))
    elif fmt == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    else:
        path = tmp_path / "dir"
        path.mkdir()
        for i, d in enumerate(docs):
            (path / f"{i:03d}.txt").write_text(d)
    cache = str(tmp_path / "cache")

    def load():
        return load_documents(path, fmt, cache)

    first = load()
    monkeypatch.setattr("mingpt.data.corpus.prepare", lambda *a, **k: pytest.fail("read again"))
    monkeypatch.setattr("mingpt.data.sources.unit_documents", lambda *a, **k: pytest.fail("read again"))
    again = load()
    assert again.tokenizer.state_dict() == first.tokenizer.state_dict()
    assert np.array_equal(again.train.starts, first.train.starts)
    assert np.array_equal(again.val.lengths, first.val.lengths)
    monkeypatch.undo()
    # a changed document (here: the last one grows) is read and tokenized again
    changed = path / "059.txt" if fmt == "files" else path
    with open(changed, "a") as fh:
        fh.write(" appended" if fmt != "jsonl" else "\n" + json.dumps({"text": "one more document"}))
    total = lambda c: int(c.train.lengths.sum() + c.val.lengths.sum())  # noqa: E731
    assert total(load()) > total(first)
