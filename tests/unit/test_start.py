"""One store, one run: a new run never mixes with another run's snapshots or metrics, a snapshot of
another shape or tokenizer is refused, and a restart of the same job always resumes."""

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_ranks_file, snapshots

from mingpt.config.compose import compose
from mingpt.config.schema import DataConfig, OptimConfig, RunConfig, TokenizerConfig
from mingpt.main import assemble
from mingpt.model.gpt import GPTConfig
from mingpt.runtime.distributed import DistInfo
from mingpt.snapshot import SnapshotError, SnapshotStore
from mingpt.snapshot.restore import read_newest
from mingpt.snapshot.start import MismatchError, check_compatible
from mingpt.training.metrics import read_records

TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.log_every=5",
        "trainer.progress=false", "optim.warmup_steps=2", "snapshot.every_steps=10"]


@pytest.fixture
def job(corpus_file, tmp_path):
    """train(run_dir, *overrides, steps=, launch_id=, restarted=) runs the real assembly and loop in this process."""

    def train(run_dir: Path, *overrides: str, steps: int = 20, launch_id: str | None = None, restarted: bool = False,
              job_id: str | None = "run1"):  # the rendezvous id every doc uses, the same in every launch
        cfg = compose([*TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'cache'}",
                              f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", *overrides])
        ids = {"launch_id": launch_id} if launch_id else {}  # else an id of this start alone
        trainer = assemble(cfg, DistInfo(job_id=job_id, restarted=restarted, **ids))
        try:
            trainer.train()
        finally:
            trainer.close()
        return trainer

    return train


def test_a_new_run_where_another_run_saved_is_refused_and_nothing_is_touched(job, tmp_path):
    run_dir = tmp_path / "run"
    job(run_dir)
    before = snapshots(run_dir)
    assert sorted(before) == [10, 20] and len(set(before.values())) == 1
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(SnapshotError) as err:
        job(run_dir, "snapshot.resume=never")
    message = str(err.value)
    assert "holds snapshots of another run (2 snapshots, steps 10-20)" in message
    assert "trainer.run_dir=runs/NEW" in message and "snapshot.move_aside=true" in message
    assert "\n" not in message
    assert snapshots(run_dir) == before and (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    # the first advice, followed, works: a run of its own
    job(tmp_path / "new", "snapshot.resume=never")
    assert sorted(snapshots(tmp_path / "new")) == [10, 20]


def test_move_aside_starts_clean_and_keeps_the_earlier_run_whole(job, tmp_path):
    run_dir = tmp_path / "run"
    job(run_dir)
    old = snapshots(run_dir)
    (run_dir / "tracker.json").write_text('{"mlflow": "0123"}')  # its tracked run's id (trainer.tracker)
    trainer = job(run_dir, "snapshot.resume=never", "snapshot.move_aside=true", "snapshot.keep_last=1", steps=10)
    assert trainer.progress.step == 10
    new = snapshots(run_dir)
    # only the new run's snapshot: not pruned by the older run's higher steps, not overwriting one of them
    assert list(new) == [10] and new[10] not in old.values()
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("snapshots.aside-")]
    kept = SnapshotStore(str(aside))
    assert {s.step: kept.read_manifest(s.path)["run_id"] for s in kept.list()} == old
    assert read_newest(kept)[1]["step"] == 20  # loadable, checksums intact
    starts = [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    assert [r["run_id"] for r in starts] == [new[10]]  # the new metrics hold the new run only
    (old_metrics,) = run_dir.glob("metrics.aside-*.jsonl")
    assert {r["run_id"] for r in read_records(old_metrics) if r["kind"] == "start"} == set(old.values())
    # and the new run, if tracked, gets a tracked run of its own
    assert not (run_dir / "tracker.json").exists()
    assert [json.loads(p.read_text()) for p in run_dir.glob("tracker.aside-*.json")] == [{"mlflow": "0123"}]


def test_a_restart_of_the_same_launch_resumes_whatever_resume_says(job, tmp_path):
    """torchrun restarts workers with the same arguments: resume=never must not start over again.
    A new launch with the same rendezvous id is a new run."""
    run_dir = tmp_path / "run"
    job(run_dir, "snapshot.resume=never", steps=10, launch_id="launch-a")
    trainer = job(run_dir, "snapshot.resume=never", steps=20, launch_id="launch-a")  # an elastic restart
    assert trainer.progress.step == 20 and sorted(snapshots(run_dir)) == [10, 20]
    # a counted restart under torchrun's default rendezvous id "none", where each start's id is its own
    trainer = job(run_dir, "snapshot.resume=never", steps=30, restarted=True, job_id=None)
    assert trainer.progress.step == 30 and len(set(snapshots(run_dir).values())) == 1  # one run
    for restarted in (False, True):  # another launch is a new run, and torchrun retrying its refusal too
        with pytest.raises(SnapshotError, match="holds snapshots of another run"):
            job(run_dir, "snapshot.resume=never", steps=20, launch_id="launch-b", restarted=restarted)
    step20 = str(run_dir / "snapshots" / "step_000000020")
    with pytest.raises(SnapshotError, match=r"resuming from .*step_000000020 \(step 20\)"):
        job(run_dir, f"snapshot.resume={step20}", steps=20, launch_id="launch-b")


def test_resuming_an_earlier_snapshot_while_later_ones_exist_is_refused(job, tmp_path):
    run_dir = tmp_path / "run"
    job(run_dir, steps=30)
    step10 = str(run_dir / "snapshots" / "step_000000010")
    with pytest.raises(SnapshotError, match=r"steps 20-30.*resuming from .*step_000000010 \(step 10\)"):
        job(run_dir, f"snapshot.resume={step10}", steps=30)
    lineage = snapshots(run_dir)
    trainer = job(run_dir, f"snapshot.resume={step10}", "snapshot.move_aside=true", steps=30)
    assert trainer.progress.step == 30
    now = snapshots(run_dir)
    assert sorted(now) == [10, 20, 30] and set(now.values()) == set(lineage.values())  # the same run, branched
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("snapshots.aside-")]
    assert sorted(p.name for p in aside.iterdir()) == ["step_000000020", "step_000000030"]
    # an explicit snapshot of another store starts an empty store without complaint
    trainer = job(tmp_path / "branch", f"snapshot.resume={step10}", steps=15)
    assert trainer.progress.step == 15 and sorted(snapshots(tmp_path / "branch")) == [15]


def test_metrics_of_an_earlier_run_without_snapshots_are_moved_aside(job, tmp_path, caplog):
    run_dir = tmp_path / "run"
    job(run_dir, "snapshot.every_steps=0", steps=5)  # the final save only...
    for p in (run_dir / "snapshots").iterdir():  # ...and then its snapshots are gone
        import shutil

        shutil.rmtree(p)
    job(run_dir, steps=10)
    assert "moved an earlier run's files aside" in caplog.text
    (aside,) = run_dir.glob("metrics.aside-*.jsonl")
    assert len([r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "start"]) == 1
    assert [r["step"] for r in read_records(aside) if r["kind"] == "train"] == [5]


def test_a_char_snapshot_resumed_with_bpe_is_refused_before_reading_data(job, tmp_path, caplog):
    """The README's BPE example after its char-level quick start, in one run_dir."""
    run_dir = tmp_path / "run"
    job(run_dir, steps=10)
    caplog.clear()
    ranks = make_ranks_file(tmp_path / "tiny.tiktoken")
    with pytest.raises(MismatchError, match=r"data.tokenizer.kind: snapshot 'char' vs config 'bpe'"):
        job(run_dir, "data.tokenizer.kind=bpe", f"data.tokenizer.ranks_file={ranks}", steps=20)
    assert "vocabulary" not in caplog.text  # refused before the corpus was tokenized


def test_another_corpus_under_a_resumed_run_is_named_not_a_missing_character(job, tmp_path, corpus_file):
    """Offline, the quick start falls back to another corpus; copying tiny Shakespeare in afterwards and
    starting again must say that the corpus changed under the resumed run."""
    run_dir = tmp_path / "run"
    job(run_dir, steps=10)
    other = tmp_path / "other.txt"
    other.write_text(corpus_file.read_text() + "$ a character the snapshot never saw\n")
    with pytest.raises(MismatchError, match=rf"this corpus does not fit the snapshot to resume \(\S*other.txt: character '\$' .*"
                                            rf"trained on {corpus_file}.*trainer.run_dir=runs/NEW"):
        job(run_dir, f"data.path={other}", steps=20)


def test_snapshot_of_another_model_shape_or_tokenizer_is_refused():
    def manifest_of(cfg: RunConfig, tokenizer: str = "char") -> dict:
        shape = replace(cfg.model, block_size=cfg.data.block_size).shape_dict()
        return {"config": cfg.to_dict(), "model_shape": shape, "tokenizer": {"kind": tokenizer}}

    cfg = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65))
    mini = RunConfig(model=GPTConfig(preset="gpt-mini", vocab_size=65))
    with pytest.raises(MismatchError, match=r"model.n_layer: snapshot 6 vs config 4.*model.n_embd: snapshot 192 vs "
                                            r"config 128.*trainer.run_dir=runs/NEW"):
        check_compatible(cfg, manifest_of(mini))
    # the context length is data.block_size, and the error names that key
    longer = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65), data=DataConfig(block_size=256))
    with pytest.raises(MismatchError, match=r"data.block_size: snapshot 256 vs config 128"):
        check_compatible(cfg, manifest_of(longer))
    # a char-level snapshot resumed with the BPE tokenizer is refused before any data is read
    with pytest.raises(MismatchError, match=r"data.tokenizer.kind: snapshot 'char' vs config 'bpe'"):
        check_compatible(replace(cfg, data=DataConfig(tokenizer=TokenizerConfig(kind="bpe"))), manifest_of(cfg))
    check_compatible(cfg, manifest_of(cfg))  # same shape and tokenizer: accepted


def test_config_changes_are_logged_only_when_real(caplog):
    cfg = RunConfig(model=GPTConfig(preset="gpt-micro", vocab_size=65))
    manifest = {"config": json.loads(json.dumps(cfg.to_dict())), "tokenizer": {"kind": "char"},
                "model_shape": replace(cfg.model, block_size=cfg.data.block_size).shape_dict()}
    with caplog.at_level(logging.INFO):
        check_compatible(cfg, manifest)  # betas saved as a JSON list, configured as a tuple: no change
        assert "config changed" not in caplog.text
        check_compatible(replace(cfg, optim=OptimConfig(lr=3e-4)), manifest)
    assert "config changed since the snapshot: optim.lr 0.001 -> 0.0003" in caplog.text
