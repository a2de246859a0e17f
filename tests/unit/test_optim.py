"""The optimizer (mingpt/training/optim.py): the learning-rate schedule and the weight-decay groups."""

import math

import pytest
import torch

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.training.optim import lr_at, param_groups


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
