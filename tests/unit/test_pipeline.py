"""trainer.pipeline_parallel in one process: the stages' split, what is refused in one line, the padded
micro-batches, the snapshot's cut by stage (the multi-process behaviour: tests/scenarios/test_pipeline_jobs.py)."""

import numpy as np
import pytest
import torch

from mingpt.config.compose import compose, summary
from mingpt.config.schema import ConfigError
from mingpt.data.samplers import LengthGroupedSampler
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.parallel.pipeline import Stage, padded, problem, stage_layers, stage_of
from mingpt.snapshot.layout import cut


@pytest.mark.parametrize("n_layer, stages, runs", [
    (4, 2, [range(0, 2), range(2, 4)]),
    (5, 2, [range(0, 3), range(3, 5)]),
    (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    (24, 4, [range(0, 6), range(6, 12), range(12, 18), range(18, 24)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
])
def test_the_blocks_are_cut_into_consecutive_runs_none_empty(n_layer, stages, runs):
    assert [stage_layers(n_layer, stages, s) for s in range(stages)] == runs


@pytest.mark.parametrize("name, stage", [
    ("model.wte.weight", 0), ("optim.wte.weight.exp_avg", 0), ("model.wpe.weight", 0),
    ("model.blocks.2.attn.c_q.weight", 1), ("optim.blocks.1.mlp.c_fc.bias.step", 0),
    ("model.ln_f.weight", 2), ("model.blocks.4.ln_1.bias", 2),
])
def test_every_tensor_has_the_stage_that_holds_it(name, stage):
    assert stage_of(name, 5, 3) == stage  # blocks 0-1, 2-3, 4


def test_interleaved_stages_take_turns_on_the_processes():
    """Two stages per process, stage s on process s % 2: 8 blocks in 4 stages of 2, processes 0 1 0 1."""
    assert [stage_of(f"model.blocks.{i}.ln_1.weight", 8, 2, chunks=2) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stage_of("model.wte.weight", 8, 2, chunks=2) == 0 and stage_of("model.ln_f.bias", 8, 2, chunks=2) == 1


@pytest.mark.parametrize("layers, stages, world, schedule, micro, message", [
    (4, 2, 4, "1f1b", 2, None),
    (4, 4, 4, "gpipe", 1, None),
    (2, 3, 3, "1f1b", 3, "trainer.pipeline_parallel=3 needs at least one block per stage, the model has 2"),
    (4, 2, 3, "1f1b", 2, "trainer.pipeline_parallel=2 needs a multiple of 2 processes, this start has 3: launch 2"),
    (4, 4, 6, "gpipe", 4, "trainer.pipeline_parallel=4 needs a multiple of 4 processes, this start has 6: launch 4"),
    (4, 4, 4, "1f1b", 3, "trainer.pipeline_schedule=1f1b over 4 stages needs at least 4 micro-batches per data rank "
                         "a step, this step has 3"),
    (4, 2, 2, "interleaved", 3, None),
    (6, 4, 4, "interleaved", 4, "trainer.pipeline_schedule=interleaved runs 2 stages on each of the 4 processes, "
                                "the model has 6 blocks for 8: use pipeline_parallel=3 or less"),
])
def test_impossible_pipelines_are_named_with_the_fix(layers, stages, world, schedule, micro, message):
    """A world the stages do not divide (an elastic restart after losing a node) and a step with fewer
    micro-batches than 1F1B needs are refused in one line that says what to change."""
    cfg = GPTConfig(preset=None, n_layer=layers, n_head=2, n_embd=16, block_size=8, vocab_size=10)
    got = problem(cfg, stages, world, schedule, micro)
    assert (got is None) if message is None else got.startswith(message), got
    assert got is None or "\n" not in got


@pytest.mark.parametrize("overrides, world, chosen", [
    ([], 2, 16),  # the defaults: 32 sequences, one pipeline of 2 stages
    (["trainer.pipeline_parallel=4", "model.n_layer=4"], 4, 8),
    (["trainer.batch_size=64"], 4, 16),  # 2 pipelines of 2 stages: 32 sequences each
    (["trainer.batch_size=8", "trainer.tensor_parallel=2", "model.n_head=2"], 4, 4),  # 1 pipeline: tp ranks are one
    (["trainer.pipeline_schedule=gpipe", "trainer.batch_size=3"], 2, 1),
    (["trainer.micro_batch_size=32"], 2, 32),  # set: kept (and refused in one line by 1F1B, as before)
])
def test_a_pipeline_left_to_its_defaults_gets_the_micro_batches_its_schedule_needs(overrides, world, chosen):
    """trainer.pipeline_parallel=2 with nothing else set runs (it was refused: 1F1B had one micro-batch of
    32 for 2 stages), and the settings screen says the micro-batch size was chosen."""
    from mingpt.main import micro_batches_per_rank

    cfg = compose(["trainer.pipeline_parallel=2", *overrides])
    fitted = cfg.for_world(world)
    assert fitted.trainer.micro_batch == chosen
    t = fitted.trainer
    gpt = GPTConfig(preset=None, n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=10)
    fits = problem(gpt, t.pipeline_parallel, world, t.pipeline_schedule,
                   micro_batches_per_rank(fitted, world // (t.pipeline_parallel * t.tensor_parallel))) is None
    assert fits == ("trainer.micro_batch_size=32" not in overrides)
    screen = next(line for line in summary(cfg, world) if line.startswith("batch"))
    assert f"micro-batches of {chosen}" in screen and ("chosen" in screen) == fits


@pytest.mark.parametrize("overrides, message", [
    (["trainer.pipeline_parallel=0"], "trainer.pipeline_parallel must be >= 1 (1 = off), got 0"),
    (["trainer.pipeline_schedule=zb"], "trainer.pipeline_schedule='zb': use 1f1b, gpipe or interleaved"),
    (["trainer.pipeline_parallel=2", "trainer.compile=true"], "trainer.compile with trainer.pipeline_parallel=2"),
    (["trainer.pipeline_parallel=2", "model.dropout=0.1"], "model.dropout with trainer.pipeline_parallel=2"),
    (["trainer.pipeline_parallel=2", "trainer.precision=fp16"], "trainer.precision=fp16 with trainer.pipeline_parallel"),
])
def test_settings_that_cannot_go_with_a_pipeline_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_stages_chained_are_the_gpt_bitwise():
    """The stage modules hold the GPT's own modules by its names; chained, they compute its logits."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(preset=None, n_layer=5, n_head=2, n_embd=16, block_size=12, vocab_size=30)).eval()
    x = torch.randint(0, 30, (3, 12))
    stages = [Stage(gpt, stage_layers(5, 3, s), s == 0, s == 2) for s in range(3)]
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, gpt(x)[0])
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in gpt.named_parameters()} | {"lm_head.weight"}  # the tied head, on the last stage
    assert stages[2].lm_head.weight is stages[0].wte.weight


def test_each_padded_micro_batch_keeps_the_samplers_real_tokens():
    """Length-grouped micro-batches (token budget, one data rank's share of a step) padded to one shape
    for the stages: each keeps its own samples, in place, and exactly its real tokens count (every
    padded row and position has target -100); an empty micro-batch (weight 0) counts nothing; padding
    micro-batches fill up to what the schedule needs."""
    lengths = np.random.default_rng(0).integers(3, 40, 300)
    sampler = LengthGroupedSampler(lengths, token_budget=160, micro_per_step=4, seed=1)
    mine = sampler.split(sampler.next_step(), 2)[0] + [np.empty(0, dtype=np.int64)]
    batches = []
    for mb in mine:
        ids = mb if len(mb) else np.array([0])
        T = int(lengths[ids].max())
        x = torch.arange(len(ids) * T).view(len(ids), T) + 1
        y = torch.full((len(ids), T), -100)
        for row, i in enumerate(ids):
            y[row, : lengths[i]] = 7
        batches.append((x, y, 1.0 if len(mb) else 0.0))
    x, y = padded(batches, at_least=8)
    B, T = max(b[0].size(0) for b in batches), max(b[0].size(1) for b in batches)
    assert x.shape == y.shape == (8 * B, T)
    for i, (bx, _, weight) in enumerate(batches):
        px, py = x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]
        assert torch.equal(px[: bx.size(0), : bx.size(1)], bx)
        real = int((py != -100).sum())
        assert real == (int(lengths[mine[i]].sum()) if weight else 0)
    assert (y[len(batches) * B:] == -100).all()


def test_the_snapshot_cut_by_stage_writes_each_tensor_once_by_its_stages_writers():
    """Two stages of two writers each: a tensor of stage s lies in writers 2s and 2s + 1's files
    alone, every row once; without stages the cut is the one every snapshot so far was written with."""
    specs = [("a", (10, 4), torch.float32), ("b", (3,), torch.float32), ("c", (7, 2), torch.float32),
             ("d", (), torch.float32)]
    stage = {"a": 0, "b": 1, "c": 1, "d": 0}
    pieces, sizes = cut(specs, writers=4, stages=2, stage_of=stage)
    for name, shape, _ in specs:
        rows = shape[0] if shape else 1
        covered = sorted((p.start, p.stop) for p in pieces[name])
        assert covered[0][0] == 0 and covered[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert {p.writer // 2 for p in pieces[name]} == {stage[name]}
    assert sum(sizes) == sum(4 * (int(np.prod(s)) if s else 1) for _, s, _ in specs)
    assert cut(specs, 4, stages=1) == cut(specs, 4)
