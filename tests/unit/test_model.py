import math

import pytest
import torch

from mingpt.model.generate import stream
from mingpt.model.gpt import GPT, PRESETS, GPTConfig, pad_vocab


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{"preset": None, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                       "vocab_size": 50, **kw})
    return GPT(cfg).eval()


def test_causal_changing_a_token_leaves_earlier_logits_unchanged():
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 50
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


def test_initial_loss_close_to_uniform():
    model = tiny(vocab_size=65)
    idx = torch.randint(0, 65, (8, 16))
    _, loss = model(idx, torch.randint(0, 65, (8, 16)))
    assert abs(loss.item() - math.log(65)) < 0.15


def test_weight_tying_and_padded_vocab_never_predicted():
    model = tiny(vocab_size=50)
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.shape[0] == 64 == pad_vocab(50)
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 50)
    out = torch.cat(list(stream(model, torch.zeros(4, 1, dtype=torch.long), 30, temperature=1.5)), dim=1)
    assert out.max().item() < 50


def test_generate_length_and_top_k():
    model = tiny()
    new = list(stream(model, torch.zeros(3, 5, dtype=torch.long), max_new_tokens=20, temperature=1.0, top_k=5))
    assert torch.cat(new, dim=1).shape == (3, 20)  # also exceeds block_size (16): context is cropped


def test_padded_targets_are_ignored():
    model = tiny()
    idx = torch.randint(0, 50, (1, 10))
    _, short = model(idx[:, :6], idx[:, 1:7])
    tgt = torch.full((1, 10), -100)
    tgt[:, :6] = idx[:, 1:7]
    padded = torch.cat([idx[:, :6], torch.zeros(1, 4, dtype=torch.long)], 1)
    _, loss = model(padded, tgt)
    # causal attention: the pad tokens after position 6 cannot change the first 6 predictions
    assert torch.allclose(short, loss, atol=1e-6)


def test_residual_projection_init_is_scaled():
    model = tiny(n_layer=8, n_embd=64, n_head=4)
    std = model.blocks[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.002
    assert abs(model.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_resolve(name):
    cfg = GPTConfig(preset=name, vocab_size=10)
    assert cfg.shape == PRESETS[name]
    assert cfg.resolved().n_embd % cfg.resolved().n_head == 0


def test_override_beats_preset_and_flops():
    cfg = GPTConfig(preset="gpt2", n_layer=2, vocab_size=100)
    assert cfg.shape == (2, 12, 768)
    model = GPT(GPTConfig(preset="gpt-nano", vocab_size=65, block_size=64))
    n = model.num_params()
    assert model.flops_per_token(64) == 6 * n + 12 * 3 * 3 * 16 * 64


@pytest.mark.parametrize("kw, message", [
    ({"preset": "gpt-huge"}, "not a known preset"),
    ({"preset": None, "n_layer": 2, "n_head": 3, "n_embd": 32}, "not divisible by model.n_head=3"),
    ({"preset": None, "n_layer": 2}, "set model.n_layer, model.n_head and model.n_embd"),
    ({"dropout": 1.5}, "dropout"),
])
def test_bad_model_config_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kw)


def test_one_initialisation_path_whatever_the_placement():
    """`init_weights(seed)` gives the same values to a model built in place and to one built on the
    meta device and materialised (the training path); another seed gives others; a model built in
    place is seeded from torch's generator."""
    from mingpt.parallel.layouts import parallelize
    from mingpt.runtime.distributed import DistInfo

    cfg = GPTConfig(preset="gpt-nano", vocab_size=65, block_size=16)
    built = GPT(cfg)
    built.init_weights(7)
    with torch.device("meta"):
        meta = GPT(cfg)
    placed = parallelize(meta, "ddp", DistInfo(), seed=7).gpt
    assert placed.lm_head.weight is placed.wte.weight  # tied again after materialising
    want, got = built.state_dict(), placed.state_dict()
    assert list(want) == list(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    other = GPT(cfg)
    other.init_weights(8)
    assert not torch.equal(other.wte.weight, built.wte.weight)
    torch.manual_seed(3)
    a = GPT(cfg)
    torch.manual_seed(3)
    assert torch.equal(a.wte.weight, GPT(cfg).wte.weight)
    assert abs(float(a.wte.weight.detach().std()) - 0.02) < 0.002  # N(0, 0.02)


def test_activation_checkpointing_keeps_less_for_the_backward_and_gives_the_same_gradients():
    """Per block: the backward recomputes what the forward no longer keeps (dropout's noise included),
    so the gradients are bitwise those without it, and the tensors saved for the backward shrink."""
    cfg = GPTConfig(preset=None, n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=50, dropout=0.1)

    def step(checkpointed: bool):
        torch.manual_seed(0)
        gpt = GPT(cfg).train()
        gpt.checkpoint_activations(checkpointed)
        x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
        saved = []

        def pack(t):
            saved.append(t.untyped_storage().nbytes() if not isinstance(t, torch.nn.Parameter) else 0)
            return t

        torch.manual_seed(1)  # the dropout noise
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = gpt(x, y)
        loss.backward()
        return {n: p.grad for n, p in gpt.named_parameters()}, sum(saved)

    plain, kept = step(False)
    checkpointed, kept_checkpointed = step(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name
    assert kept_checkpointed < kept / 2, (kept_checkpointed, kept)
