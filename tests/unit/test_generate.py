"""Sampling uses exactly the context a model was trained with: no untrained position is ever fed."""

import subprocess
import sys

import torch
from conftest import REPO, save_state

from mingpt.cli.generate import load_model
from mingpt.config.compose import compose
from mingpt.main import assemble
from mingpt.model.generate import stream
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.runtime.distributed import DistInfo
from mingpt.snapshot import SnapshotStore

BLOCK = 16


def positions_fed(model: GPT) -> list[int]:
    """Record the sequence length of every forward call."""
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    return seen


def test_a_model_trained_at_a_short_context_is_sampled_at_that_context(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose(["model=gpt-nano", f"data.block_size={BLOCK}", f"data.path={corpus_file}",
                          f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}", "trainer.max_steps=30",
                          "trainer.batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0",
                          "trainer.progress=false"])
    trainer = assemble(cfg, DistInfo())
    trainer.train()
    trainer.close()
    model, manifest = load_model(str(run_dir / "snapshots"))
    assert model.config.block_size == BLOCK and model.wpe.weight.shape[0] == BLOCK
    seen = positions_fed(model)
    new = list(stream(model, torch.zeros(1, 1, dtype=torch.long), max_new_tokens=5 * BLOCK, temperature=1.0,
                            generator=torch.Generator().manual_seed(0)))
    assert len(new) == 5 * BLOCK  # several times the context was sampled...
    assert max(seen) == BLOCK  # ...and never more positions than were trained

    # the command line says the same, given the run directory (its snapshots/)
    cli = subprocess.run([sys.executable, "-m", "mingpt.cli.generate", str(run_dir), "--prompt", "Speaker",
                          "--max-new-tokens", str(5 * BLOCK)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("Speaker") and len(cli.stdout) == len("Speaker") + 5 * BLOCK + 1  # and "\n"
    # which snapshot it samples, and with how many threads (a small model: one, whatever the cores)
    assert f"sampling from the snapshot of step 30 in {run_dir / 'snapshots'} (run " in cli.stderr
    assert "M parameters, cpu, 1 thread)" in cli.stderr


def test_a_reader_that_stops_early_ends_generation_quietly(tmp_path):
    shape = GPTConfig(preset="gpt-nano", vocab_size=20, block_size=16)
    manifest = {"config": {"data": {"block_size": 16}}, "tokenizer": {"kind": "char", "chars": "abcdefghijklmnopqrst"},
                "model_shape": shape.shape_dict()}
    save_state(SnapshotStore(str(tmp_path / "run" / "snapshots")), 1, {"model": GPT(shape).state_dict()}, manifest)
    cli = subprocess.run(f"{sys.executable} -m mingpt.cli.generate {tmp_path / 'run'} --prompt a --max-new-tokens 100000 "
                         "--num-samples 100 | head -c 10", shell=True, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert len(cli.stdout) == 10  # no BrokenPipeError traceback: our one line, nothing else
    assert cli.stderr.startswith("mingpt-generate: sampling from the snapshot of step 1") and cli.stderr.count("\n") == 1


def test_a_damaged_snapshot_on_s3_is_named_by_its_url(s3):
    import pytest
    import s3fs

    from mingpt.snapshot import SnapshotError

    fs = s3fs.S3FileSystem()
    fs.mkdir("gen-damaged")
    shape = GPTConfig(preset="gpt-nano", vocab_size=20, block_size=16)
    manifest = {"tokenizer": {"kind": "char", "chars": "abcdefghijklmnopqrst"}, "model_shape": shape.shape_dict()}
    save_state(SnapshotStore("s3://gen-damaged/run"), 1, {"model": GPT(shape).state_dict()}, manifest)
    fs.pipe_file("gen-damaged/run/step_000000001/shard-00000-of-00001.bin", b"short")
    with pytest.raises(SnapshotError, match=r"^snapshot s3://gen-damaged/run/step_000000001 is incomplete: "
                                            r"shard-00000-of-00001.bin has 5 bytes"):
        load_model("s3://gen-damaged/run/step_000000001")
