"""trainer.tensor_parallel: what is refused, in one line (the multi-process behaviour:
tests/scenarios/test_tp_jobs.py)."""

import pytest

from mingpt.config.compose import compose
from mingpt.config.schema import ConfigError
from mingpt.model.plan import BLOCK, BLOCKS, TOP
from mingpt.parallel.tensor import problem


@pytest.mark.parametrize("n_head, block, vocab, size, per_node, message", [
    (4, 64, 65, 2, [2], None),
    (4, 64, 50257, 4, [4, 8], None),
    (6, 64, 65, 4, [4], "trainer.tensor_parallel=4 does not divide model.n_head=6: each process needs whole attention "
                        "heads"),
    (4, 66, 65, 4, [4], "trainer.tensor_parallel=4 does not divide data.block_size=66: the processes of a group split "
                        "the sequence evenly"),
    (3, 66, 65, 3, [3], "trainer.tensor_parallel=3 does not divide the vocabulary (65 tokens, padded to 128)"),
    (4, 64, 65, 2, [2, 3], "trainer.tensor_parallel=2 does not divide the processes per node (3 here)"),
    (4, 64, 65, 4, [2], "trainer.tensor_parallel=4 does not divide the processes per node (2 here)"),
])
def test_impossible_shapes_are_named_with_the_fix(n_head, block, vocab, size, per_node, message):
    from mingpt.model.gpt import GPTConfig

    cfg = GPTConfig(preset=None, n_layer=1, n_head=n_head, n_embd=8 * n_head, block_size=block, vocab_size=vocab)
    got = problem(cfg, size, per_node)
    assert (got is None) if message is None else got.startswith(message), got


@pytest.mark.parametrize("overrides, message", [
    (["trainer.tensor_parallel=0"], "trainer.tensor_parallel must be >= 1 (1 = off), got 0"),
    (["trainer.tensor_parallel=2", "model.init_from=gpt2", "data.tokenizer.kind=bpe"],
     "model.init_from with trainer.tensor_parallel=2 is not supported"),
    (["trainer.tensor_parallel=2", "trainer.compile=true"],
     "trainer.compile with trainer.tensor_parallel=2 is not supported: torch.compile fails on the split model"),
])
def test_settings_that_cannot_go_with_tensor_parallelism_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        compose(overrides)


def test_the_plan_splits_every_projection_of_a_block_once():
    """Megatron's pairs: each column-split layer feeds a row-split one, so a block needs one
    all-reduce forward per sub-layer."""
    from mingpt.model.gpt import GPT, GPTConfig

    block = GPT(GPTConfig(preset="gpt-nano", vocab_size=10, block_size=8)).blocks[0]
    linears = {name for name, m in block.named_modules() if m.__class__.__name__ == "Linear"}
    assert {n for n, kind in BLOCK.items() if kind in ("colwise", "rowwise")} == linears
    assert [BLOCK[n] for n in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj")] == ["colwise"] * 3 + ["rowwise"]
    assert [BLOCK[n] for n in ("mlp.c_fc", "mlp.c_proj")] == ["colwise", "rowwise"]


def test_the_plan_names_modules_the_model_has():
    """A module renamed in gpt.py and not in model/plan.py fails here, not in a tensor-parallel job."""
    from mingpt.model.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(preset="gpt-nano", vocab_size=10, block_size=8))
    names = dict(gpt.named_modules())
    assert all(name in names for name in TOP)
    assert all(f"{BLOCKS}.{i}.{name}" in names for i in range(len(getattr(gpt, BLOCKS))) for name in BLOCK)
