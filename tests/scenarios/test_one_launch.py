"""One launch, one id (mingpt/cli/launch_id.py): users reuse a job secret for several launches, and
each launch under mingpt-torchrun is still a launch of its own to the store's lease and to
snapshot.resume."""

import secrets
import subprocess
import sys
import time

from conftest import REPO, records, snapshots, torchrun_env

TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.log_every=1",
        "trainer.progress=false", "snapshot.every_steps=5", "snapshot.lease_s=2"]


def launch(corpus, tmp_path, secret: str, name: str, *overrides: str) -> tuple[subprocess.Popen, object]:
    """mingpt-torchrun --standalone, one worker, with the job secret `secret` (the README's reused file)."""
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--standalone", "--nproc_per_node=1", "--max-restarts=1",
           "mingpt/main.py", *TINY, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
           f"trainer.run_dir={tmp_path / 'run'}", *overrides]
    log = tmp_path / f"{name}.log"  # a file: a pipe read only at the end can fill and stop the job
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(MINGPT_JOB_SECRET=secret), text=True, stdout=fh,
                                stderr=subprocess.STDOUT)
    return proc, log


def test_a_second_launch_with_the_same_secret_is_refused_by_the_lease_in_one_line(corpus_file, tmp_path):
    """Before: both launches had the secret's launch id; the second took the lease over as a restart of
    the first would, and both trained into one store."""
    secret = secrets.token_hex(32)
    first, first_log = launch(corpus_file, tmp_path, secret, "first", "trainer.max_steps=1000000")
    try:
        while not any(r.get("kind") == "train" for r in records(tmp_path / "run" / "metrics.jsonl")):
            assert first.poll() is None, first_log.read_text()[-3000:]
            time.sleep(0.05)
        second, log = launch(corpus_file, tmp_path, secret, "second", "trainer.max_steps=10")
        assert second.wait(timeout=120) == 2, log.read_text()[-3000:]
        errors = [line for line in log.read_text().splitlines() if "ERROR" in line or "Traceback" in line]
        assert len(errors) == 1 and "another launch of this job, live" in errors[0], errors
        assert "make a secret per job" in errors[0]
        assert first.poll() is None, first_log.read_text()[-3000:]  # the first trains on
    finally:
        first.kill()
        first.wait()
    assert [r["kind"] for r in records(tmp_path / "run" / "metrics.jsonl")].count("start") == 1


def test_resume_never_is_never_for_a_new_launch_with_the_same_secret(corpus_file, tmp_path):
    """Before: the second launch had the first's launch id, so it "resumed its own snapshot" whatever
    snapshot.resume=never said."""
    secret = secrets.token_hex(32)
    first, log = launch(corpus_file, tmp_path, secret, "first", "trainer.max_steps=10")
    assert first.wait(timeout=120) == 0, log.read_text()[-3000:]
    before = snapshots(tmp_path / "run")
    second, log = launch(corpus_file, tmp_path, secret, "second", "trainer.max_steps=20", "snapshot.resume=never")
    assert second.wait(timeout=120) == 2, log.read_text()[-3000:]
    assert "holds snapshots of another run" in log.read_text(), log.read_text()[-3000:]
    assert snapshots(tmp_path / "run") == before
