"""mingpt-export (mingpt/cli/export.py): a snapshot out as a GPT-2 checkpoint that transformers loads."""

import json
import os
import stat

import pytest
import torch
from conftest import BLOCK, bpe_overrides, gpt2_ranks, hf_logits, save_state

from mingpt.cli.export import export
from mingpt.config.compose import compose
from mingpt.main import assemble
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.model.tokenizer import build_bpe
from mingpt.runtime.distributed import DistInfo
from mingpt.snapshot import SnapshotStore

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")


def test_export_loads_in_transformers_with_our_logits_and_tokenizer(hf_dir, corpus_file, tmp_path):
    path, _ = hf_dir
    run_dir = tmp_path / "run"
    trainer = assemble(compose(bpe_overrides(corpus_file, tmp_path, run_dir, f"model.init_from={path}",
                                             "trainer.max_steps=2")), DistInfo())
    trainer.train()
    trainer.close()
    out = tmp_path / "export"
    note = export(str(run_dir / "snapshots"), out, ranks_file=gpt2_ranks())
    assert "exported step 2" in note and "tokenizer files written" in note
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, 50257, (2, BLOCK))
    ours, _ = trainer.parallel.gpt.eval()(ids)
    torch.testing.assert_close(hf_logits(hf, ids), ours, atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "ROMEO:  Wherefore art thou?\n\tNaïve café – 東京 🙂 it's 1234 isn't"
    assert hf_tok.encode(text) == build_bpe(gpt2_ranks()).encode(text)
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
