"""One store, one run: a new run never mixes with another run's snapshots or metrics, retention never
deletes the current run's newest snapshot, and a restart of the same job always resumes."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, make_ranks_file, save_state, torchrun_env
from conftest import records as live_records

from mingpt.compose import compose
from mingpt.distributed import DistInfo
from mingpt.main import assemble
from mingpt.snapshot import SnapshotError, SnapshotStore, Snapshotter
from mingpt.snapshot.layout import Slot
from mingpt.snapshot.start import MismatchError

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


def snapshots(run_dir: Path) -> dict[int, str]:
    """step -> run id of every committed snapshot in run_dir/snapshots."""
    store = SnapshotStore(str(run_dir / "snapshots"))
    return {s.step: store.read_manifest(s.path)["run_id"] for s in store.list() if s.committed}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    trainer = job(run_dir, "snapshot.resume=never", "snapshot.move_aside=true", "snapshot.keep_last=1", steps=10)
    assert trainer.progress.step == 10
    new = snapshots(run_dir)
    # only the new run's snapshot: not pruned by the older run's higher steps, not overwriting one of them
    assert list(new) == [10] and new[10] not in old.values()
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("snapshots.aside-")]
    kept = SnapshotStore(str(aside))
    assert {s.step: kept.read_manifest(s.path)["run_id"] for s in kept.list()} == old
    assert kept.load_latest()[1]["step"] == 20  # loadable, checksums intact
    starts = [r for r in records(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    assert [r["run_id"] for r in starts] == [new[10]]  # the new metrics hold the new run only
    (old_metrics,) = run_dir.glob("metrics.aside-*.jsonl")
    assert {r["run_id"] for r in records(old_metrics) if r["kind"] == "start"} == set(old.values())


def test_retention_never_deletes_the_newest_snapshot_of_this_run(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"))
    for step in (100, 200):  # higher steps that are not this run's (e.g. a broken newer lineage)
        save_state(store, step, {"model": {"w": torch.zeros(1)}}, {})
    snap = Snapshotter(store, keep_last=1)
    snap.save(5, [Slot("model.w", torch.ones(1), (1,))], {}, {})
    snap.close()
    assert 5 in [s.step for s in store.list() if s.committed]


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


def test_launch_id_from_the_launcher_else_torchrun_else_this_process():
    env = {"TORCHELASTIC_RUN_ID": "run1", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert DistInfo.from_env({**env, "MINGPT_LAUNCH_ID": "l1"}, cuda=False).launch_id == "l1"
    assert DistInfo.from_env(env, cuda=False).launch_id == "run1" and not DistInfo.from_env(env, cuda=False).restarted
    assert DistInfo.from_env({**env, "TORCHELASTIC_RESTART_COUNT": "2"}, cuda=False).restarted
    # torchrun's default id "none" and plain python: every start is a launch of its own
    assert len({DistInfo.from_env(e, cuda=False).launch_id for e in ({}, {}, {"TORCHELASTIC_RUN_ID": "none"})}) == 3


@pytest.mark.slow
def test_a_second_launch_with_the_same_rendezvous_id_is_refused_and_a_torchrun_restart_resumes(corpus_file, tmp_path):
    """The documented command twice (--rdzv_id=run1, snapshot.resume=never): the second launch is
    refused; a worker SIGKILLed in the first one is restarted by torchrun and resumes its own run."""
    run_dir = tmp_path / "run"

    def launch(launch_id: str, **kw):  # the launch id mingpt-torchrun derives from a new job secret
        cmd = [*torchrun_cmd_c10d(), "mingpt/main.py", *TINY, f"data.path={corpus_file}", "snapshot.every_steps=5",
               f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}", "trainer.max_steps=400",
               "trainer.log_every=1", "snapshot.resume=never"]
        log = tmp_path / f"{launch_id}.log"  # a file: a pipe read only at the end can fill and stop the job
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(MINGPT_LAUNCH_ID=launch_id), text=True,
                                    stdout=fh, stderr=subprocess.STDOUT, **kw)
        return proc, log

    first, log = launch("launch-1")
    # 400 steps of a few ms: the SIGKILL lands while the first attempt trains (at 40 it had once finished)
    while not any(r.get("kind") == "train" and r["step"] >= 6 for r in live_records(run_dir / "metrics.jsonl")):
        assert first.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    worker = int(Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()[0])
    os.kill(worker, signal.SIGKILL)
    first.wait(timeout=300)
    out = log.read_text()
    assert first.returncode == 0, out[-3000:]
    resumes = [r for r in live_records(run_dir / "metrics.jsonl") if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 5, out[-3000:]
    before = snapshots(run_dir)
    assert max(before) == 400 and len(set(before.values())) == 1
    second, log = launch("launch-2")
    second.wait(timeout=300)
    out = log.read_text()
    assert second.returncode != 0 and "holds snapshots of another run" in out, out[-3000:]
    assert snapshots(run_dir) == before


def torchrun_cmd_c10d() -> list[str]:
    """torchrun as the docs launch it: a c10d rendezvous named run1, one worker, one restart allowed."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1", "--max-restarts=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=run1"]


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
    assert len([r for r in records(run_dir / "metrics.jsonl") if r["kind"] == "start"]) == 1
    assert [r["step"] for r in records(aside) if r["kind"] == "train"] == [5]


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


def _readme_runs() -> list[list[str]]:
    """The training commands of the shell blocks of the README and docs/ (each once), as argument lists."""
    text = "".join(p.read_text() for p in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))])
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            if re.search(r"mingpt/main\.py|-m mingpt\.main", line) and shlex.split(line) not in cmds:
                cmds.append(shlex.split(line))
    return cmds


def test_readme_training_examples_each_have_a_run_directory_of_their_own():
    """Run in any order, the examples never resume (or refuse) each other's snapshots."""
    dirs = []
    for args in _readme_runs():
        run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("trainer.run_dir=")), None)
        options = [a for a in args if re.match(r"^(trainer|experiment)=", a)]  # options may set trainer.run_dir
        if run_dir is None:
            run_dir = compose(options).trainer.run_dir
        snap = next((a.split("=", 1)[1] for a in args if a.startswith("snapshot.dir=")), f"{run_dir}/snapshots")
        dirs.append((run_dir, snap, " ".join(args)))
    assert len(dirs) >= 4
    for field in (0, 1):
        seen = {}
        for d in dirs:
            assert d[field] not in seen, f"{d[2]!r} shares {d[field]} with {seen[d[field]]!r}"
            seen[d[field]] = d[2]
