"""GPT-2 weights in and out, with Hugging Face transformers as the reference no one here wrote."""

import json
import os

import pytest
import torch
from conftest import BLOCK, bpe_overrides, hf_logits

from mingpt.config.compose import compose
from mingpt.config.schema import ConfigError
from mingpt.main import assemble
from mingpt.model.generate import stream
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.model.pretrained import PretrainedError, locate, read_config, read_weights
from mingpt.runtime.distributed import DistInfo

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")


def test_init_from_a_checkpoint_gives_transformers_logits_and_a_snapshot_wins_on_restart(hf_dir, corpus_file,
                                                                                         tmp_path):
    path, hf = hf_dir
    run_dir = tmp_path / "run"
    overrides = bpe_overrides(corpus_file, tmp_path, run_dir, f"model.init_from={path}", "trainer.max_steps=3")
    trainer = assemble(compose(overrides), DistInfo())
    ids = torch.randint(0, 50257, (2, BLOCK))
    ours, _ = trainer.parallel.gpt.eval()(ids)
    assert trainer.parallel.gpt.config.shape == (2, 2, 32) and trainer.progress.step == 0
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-5, rtol=0)
    trainer.train()
    trainer.close()
    # the restart resumes the fine-tuned snapshot instead of starting again from the checkpoint
    trainer = assemble(compose([*overrides[:-1], "trainer.max_steps=4"]), DistInfo())
    assert trainer.progress.step == 3
    after, _ = trainer.parallel.gpt.eval()(ids)
    assert not torch.allclose(after, hf_logits(hf, ids), atol=1e-5)
    trainer.close()


def test_kv_cache_greedy_generation_equals_recomputing_the_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(preset="gpt-nano", vocab_size=100, block_size=24)).eval()
    idx = torch.randint(0, 100, (3, 5))
    # 60 new tokens: the context fills up (24) and slides, both with and without the cache
    plain = torch.cat([idx, *stream(model, idx, 60, temperature=0, use_cache=False)], dim=1)
    cached = torch.cat([idx, *stream(model, idx, 60, temperature=0, use_cache=True)], dim=1)
    assert torch.equal(plain, cached) and cached.shape == (3, 65)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    from mingpt.model.generate import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample(logits, 1.0, top_p=0.75, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.75: the rest is cut
    seen = {int(sample(logits, 1.0, top_p=0.4, generator=torch.Generator().manual_seed(s))) for s in range(50)}
    assert seen == {0}


@pytest.mark.parametrize("case", ["no-weights", "llama", "char-tokenizer", "offline-hub-name"])
def test_bad_starting_points_are_one_clear_line(case, tmp_path, monkeypatch):
    if case == "no-weights":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2,
                                                          "n_embd": 32, "n_positions": 64, "vocab_size": 50257}))
        with pytest.raises(PretrainedError, match=r"has no model.safetensors or pytorch_model.bin"):
            read_weights(tmp_path)
    elif case == "llama":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
        with pytest.raises(PretrainedError, match=r"holds a 'llama' model \(LlamaForCausalLM\); model.init_from takes "
                                                  r"GPT-2 checkpoints"):
            read_config(tmp_path)
    elif case == "char-tokenizer":
        with pytest.raises(ConfigError, match=r"model.init_from=gpt2 starts from GPT-2's weights.*data.tokenizer.kind=bpe"):
            compose(["model.init_from=gpt2"])
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
        with pytest.raises(PretrainedError) as e:
            locate("gpt2-medium")
        message = str(e.value)
        assert "HF_HUB_OFFLINE is set" in message and "model.init_from=DIR" in message and "\n" not in message


def test_the_bin_format_is_read_without_unpickling_code(tmp_path, hf_dir):
    """Pickle-only checkpoints load with weights_only=True: tensors only, never arbitrary objects."""
    path, hf = hf_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert read_weights(tmp_path)["wte.weight"].shape == (50257, 32)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"wte.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        read_weights(tmp_path)
