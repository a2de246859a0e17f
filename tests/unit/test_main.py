"""The training command as a user starts it: what a start that fails leaves behind."""

import os
import subprocess
import sys

from conftest import REPO


def test_a_start_that_fails_leaves_no_empty_snapshot_store(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", f"data.path={tmp_path / 'missing.txt'}",
                           f"trainer.run_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "missing.txt does not exist" in proc.stderr
    assert not (tmp_path / "run").exists()  # nor an empty run directory


TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.eval_every=0",
        "trainer.progress=false"]


def test_a_run_on_s3_logs_our_lines_with_full_urls_and_a_missing_bucket_is_named(s3, corpus_file, tmp_path):
    import s3fs

    s3fs.S3FileSystem().mkdir("main-logs")
    base = [sys.executable, "-m", "mingpt.main", *TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'c'}"]
    run = subprocess.run([*base, f"trainer.run_dir={tmp_path / 'run'}", "snapshot.dir=s3://main-logs/run"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "snapshot step 2 committed to s3://main-logs/run/step_000000002 " in run.stderr
    assert "botocore" not in run.stderr and "s3fs" not in run.stderr  # no INFO lines of the S3 client
    missing = subprocess.run([*base, f"trainer.run_dir={tmp_path / 'run2'}", "snapshot.dir=s3://no-such-bucket/run"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert (f"ERROR mingpt: bucket no-such-bucket of s3://no-such-bucket/run does not exist or is not reachable at "
            f"{s3.env['AWS_ENDPOINT_URL']}: create the bucket, or correct snapshot.dir") in missing.stderr


def test_replica_groups_are_refused_where_they_cannot_work(monkeypatch):
    """A group over several nodes, or a job without the secret the groups prove themselves with:
    one line that says what to do, before anything listens."""
    import pytest

    from mingpt.config.compose import compose
    from mingpt.replicas import ReplicaError
    from mingpt.runtime.distributed import DistInfo
    from mingpt.training.replica_launch import ReplicaLaunch, as_member

    cfg = compose(["replicas.peers=[127.0.0.1:1,127.0.0.1:2]", "replicas.group=0"])
    monkeypatch.delenv("MINGPT_JOB_SECRET", raising=False)
    monkeypatch.delenv("MINGPT_JOB_SECRET_FILE", raising=False)
    two_nodes = DistInfo(world_size=4, local_world_size=2)  # a group's torchrun of two nodes with two processes each
    with pytest.raises(ReplicaError, match="a replica group is one node's torchrun.*run one group per node"):
        as_member(cfg, two_nodes)
    with pytest.raises(ReplicaError, match="a replica group is one node's torchrun.*run one group per node"):
        ReplicaLaunch(cfg, two_nodes)
    with pytest.raises(ReplicaError, match="give every group the same MINGPT_JOB_SECRET"):
        ReplicaLaunch(cfg, as_member(cfg, DistInfo(world_size=2, local_world_size=2, local_rank=1)))
    plain = DistInfo()
    assert as_member(compose([]), plain) is plain  # off by default


def test_the_start_line_says_when_the_kernels_are_deterministic(corpus_file, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", *TINY, "trainer.deterministic=true",
                           f"data.path={corpus_file}", f"trainer.run_dir={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training from step 0 to 2 on 1 rank (single), precision fp32, deterministic kernels" in proc.stderr
    # and the last line says it finished, where the snapshot is and how to sample from it
    assert "finished: step 2 in " in proc.stderr and f"snapshot in {tmp_path / 'run' / 'snapshots'} (sample: " \
        f"mingpt-generate {tmp_path / 'run'})" in proc.stderr


def test_a_replica_groups_process_initialises_its_model_even_when_a_snapshot_waits():
    """A restarted process of a replica group may heal from a peer instead of reading the snapshot it
    found: its weights are filled from the seed first, so a heal that goes wrong can never spread
    uninitialised memory (the review's NaN rewind). A plain job leaves them for the snapshot."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from mingpt.config.compose import compose
    from mingpt.main import build_model
    from mingpt.runtime.distributed import DistInfo

    start = SimpleNamespace(candidates=["step_000000075"], manifest={"step": 75}, pretrained=None)

    def sized(cfg):  # what build_data sets from the tokenizer and the data
        return replace(cfg, model=replace(cfg.model, vocab_size=65, block_size=cfg.data.block_size))

    fresh = build_model(sized(compose(TINY)), DistInfo(), SimpleNamespace(candidates=[], manifest=None, pretrained=None))
    replica = build_model(sized(compose([*TINY, "replicas.peers=[127.0.0.1:1,127.0.0.1:2]", "replicas.group=1"])),
                          DistInfo(), start)
    for (name, a), b in zip(fresh.gpt.state_dict().items(), replica.gpt.state_dict().values()):
        assert torch.equal(a, b), name


def test_nanogpts_dashed_habit_gets_one_line_that_says_how():
    """`--max_steps=10` used to print Hydra's 16-line usage (once per rank under torchrun)."""
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", "--max_steps=10"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("--max_steps=10: settings are written without dashes, key=value (did you mean "
                                        "trainer.max_steps=10?)")
    assert proc.stderr.count("\n") == 1 and "usage" not in proc.stderr


def test_tensorboard_not_installed_is_one_line_before_anything_is_built(corpus_file, tmp_path):
    """Before: a 20-line traceback (exit 1) once the corpus and the model were built. A shadow package
    that raises ImportError, first on the path, stands for TensorBoard not installed."""
    (tmp_path / "shadow" / "tensorboard").mkdir(parents=True)
    (tmp_path / "shadow" / "tensorboard" / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", *TINY, "trainer.tensorboard=true",
                           f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}",
                           f"trainer.run_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(REPO)])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("trainer.tensorboard=true needs tensorboard, which is not installed: pip install "
                                        "'mingpt[tensorboard]' (in a checkout: pip install -e '.[tensorboard]')")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # no corpus prepared, no run
