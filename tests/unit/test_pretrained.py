"""GPT-2 weights in and out, with Hugging Face transformers as the reference no one here wrote."""

import json
import os
import stat
import subprocess

import pytest
import torch
from conftest import REPO, SHARED_DATA, save_state, torchrun_cmd, torchrun_env

from mingpt.cli.export import export
from mingpt.compose import compose
from mingpt.config import ConfigError
from mingpt.distributed import DistInfo
from mingpt.main import assemble
from mingpt.model import GPT, GPTConfig
from mingpt.pretrained import PretrainedError, locate, read_config, read_weights
from mingpt.snapshot import SnapshotStore
from mingpt.tokenizer import build_bpe

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")
RANKS = SHARED_DATA / "r50k_base.tiktoken"
BLOCK = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random GPT-2 with GPT-2's full vocabulary, saved the way the hub serves them."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(path)
    return path, model


def bpe_overrides(corpus, tmp_path, run_dir, *extra):
    return ["data=shakespeare_bpe", f"data.block_size={BLOCK}", f"data.tokenizer.ranks_file={RANKS}",
            f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}",
            "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.progress=false",
            "optim.warmup_steps=0", "optim.lr=1e-4", "optim.min_lr=1e-4", *extra]


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


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


def test_a_few_finetuning_steps_under_torchrun(hf_dir, corpus_file, tmp_path):
    path, _ = hf_dir
    run_dir = tmp_path / "run"
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *bpe_overrides(corpus_file, tmp_path, run_dir),
                                       f"model.init_from={path}", "trainer.max_steps=4", "trainer.log_every=2"),
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stderr and "model shape from" in proc.stderr
    state, manifest = SnapshotStore(str(run_dir / "snapshots")).load_latest()
    assert manifest["step"] == 4 and manifest["model_shape"]["n_layer"] == 2


def test_export_loads_in_transformers_with_our_logits_and_tokenizer(hf_dir, corpus_file, tmp_path):
    path, _ = hf_dir
    run_dir = tmp_path / "run"
    trainer = assemble(compose(bpe_overrides(corpus_file, tmp_path, run_dir, f"model.init_from={path}",
                                             "trainer.max_steps=2")), DistInfo())
    trainer.train()
    trainer.close()
    out = tmp_path / "export"
    note = export(str(run_dir / "snapshots"), out, ranks_file=str(RANKS))
    assert "exported step 2" in note and "tokenizer files written" in note
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, 50257, (2, BLOCK))
    ours, _ = trainer.parallel.gpt.eval()(ids)
    torch.testing.assert_close(hf_logits(hf, ids), ours, atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "ROMEO:  Wherefore art thou?\n\tNaïve café – 東京 🙂 it's 1234 isn't"
    assert hf_tok.encode(text) == build_bpe(str(RANKS)).encode(text)
    assert hf_tok.decode(hf_tok.encode(text)) == text


def test_a_character_level_run_exports_its_weights_and_says_there_is_no_tokenizer(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    trainer = assemble(compose(["model=gpt-nano", f"data.block_size={BLOCK}", f"data.path={corpus_file}",
                                f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}",
                                "trainer.max_steps=2", "trainer.eval_every=0", "trainer.progress=false"]), DistInfo())
    trainer.train()
    trainer.close()
    out = tmp_path / "export"
    note = export(str(run_dir), out)  # the run directory: its snapshots/
    assert "transformers has no tokenizer for it" in note
    umask = os.umask(0o022)
    os.umask(umask)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "mingpt_tokenizer.json"], 0o666 & ~umask)  # to share, as the umask says
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, trainer.parallel.gpt.config.vocab_size, (1, BLOCK))
    torch.testing.assert_close(hf_logits(hf, ids), trainer.parallel.gpt.eval()(ids)[0], atol=1e-5, rtol=0)
    assert json.loads((out / "mingpt_tokenizer.json").read_text())["kind"] == "char"


def test_export_from_an_s3_store(s3, tmp_path):
    import s3fs

    s3fs.S3FileSystem().mkdir("export-bucket")
    shape = GPTConfig(preset="gpt-nano", vocab_size=65, block_size=16)
    model = GPT(shape)
    manifest = {"model_shape": shape.shape_dict(), "tokenizer": {"kind": "char", "chars": "x" * 65}}
    save_state(SnapshotStore("s3://export-bucket/run"), 7, {"model": model.state_dict()}, manifest)
    note = export("s3://export-bucket/run", tmp_path / "out")
    assert "exported step 7" in note
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 65, (1, 16))
    torch.testing.assert_close(hf_logits(hf, ids), model.eval()(ids)[0], atol=1e-5, rtol=0)


def test_kv_cache_greedy_generation_equals_recomputing_the_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(preset="gpt-nano", vocab_size=100, block_size=24)).eval()
    idx = torch.randint(0, 100, (3, 5))
    # 60 new tokens: the context fills up (24) and slides, both with and without the cache
    plain = model.generate(idx, 60, temperature=0, use_cache=False)
    cached = model.generate(idx, 60, temperature=0, use_cache=True)
    assert torch.equal(plain, cached) and cached.shape == (3, 65)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    from mingpt.model import sample

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
