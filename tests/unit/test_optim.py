"""The optimizer (mingpt/training/optim.py): the learning-rate schedule and the weight-decay groups."""

import math

import pytest
import torch

from mingpt.model.gpt import GPT, GPTConfig
from mingpt.training.optim import build_optimizer, init_state, lr_at, param_groups


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


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_and_both_learn():
    """trainer.optimizer=muon: torch's Muon over every block's 2-D matrix, AdamW over the embeddings (the
    tied head), norms and biases; its state exists before the first step (a snapshot can load into it),
    by parameter, and the schedule's lr reaches every group."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(preset=None, n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40))
    opt = init_state(build_optimizer(gpt, 3e-3, (0.9, 0.95), 0.1, "muon"))
    names = {p: n for n, p in gpt.named_parameters()}
    keys = {names[p]: sorted(opt.state[p]) for p in names}
    assert {n for n, k in keys.items() if k == ["momentum_buffer"]} == {
        n for n, p in gpt.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert keys["wte.weight"] == keys["blocks.0.ln_1.weight"] == keys["blocks.0.attn.c_q.bias"] == \
        ["exp_avg", "exp_avg_sq", "step"]
    assert len(opt.state) == len(names) and sum(len(g["params"]) for g in opt.param_groups) == len(names)
    for group in opt.param_groups:
        group["lr"] = 3e-3
    x = torch.randint(0, 40, (8, 16))
    losses = []
    for _ in range(20):
        _, loss = gpt(x, x)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is None for p in gpt.parameters())
    assert opt.state[gpt.blocks[0].mlp.c_fc.weight]["momentum_buffer"].abs().sum() > 0
