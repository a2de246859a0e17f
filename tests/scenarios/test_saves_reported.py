"""Nothing is reported saved that was not saved: a store the job cannot write to is refused at start,
and a final or preemption snapshot that fails is one error line and exit code 74, never "saved".
The runs are real processes without root's capabilities, so that file permissions bite."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, WITHOUT_CAPABILITIES, make_corpus, records

pytestmark = pytest.mark.slow

CFG = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.block_size=32",
       "trainer.batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.log_every=1",
       "trainer.progress=false", "optim.warmup_steps=2", "snapshot.retries=0"]


def run_args(d, store, **over):
    corpus = make_corpus(d)
    args = [*CFG, f"data.path={corpus}", f"data.cache_dir={d / 'cache'}", f"trainer.run_dir={d / 'run'}",
            f"snapshot.dir={store}", *[f"{k.replace('__', '.')}={v}" for k, v in over.items()]]
    return [*WITHOUT_CAPABILITIES, sys.executable, "-m", "mingpt.main", *args]


def env_of(d):
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def test_a_store_the_job_cannot_write_to_is_refused_at_start(tmp_path):
    store = tmp_path / "readonly-store"
    store.mkdir()
    store.chmod(0o555)  # may be listed, not written to
    proc = subprocess.run(run_args(tmp_path, store, trainer__max_steps=3), cwd=REPO, env=env_of(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"cannot use snapshot store {store}" in proc.stderr and "Permission" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "train" not in (
        tmp_path / "run" / "metrics.jsonl").read_text()


def wait_for_step(metrics, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        steps = [r.get("step", 0) for r in records(metrics)]
        if steps and max(steps) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached")


@pytest.mark.parametrize("how", ["finished", "preempted"])
def test_a_stop_whose_snapshot_fails_says_so_and_exits_74(tmp_path, how):
    """The store becomes unwritable during the run (here: its owner changes); the final save, or the
    preemption save on SIGTERM, fails: exit code 74 and one line that says so, never "saved"."""
    store = tmp_path / "store"
    store.mkdir()
    steps = 40 if how == "finished" else 100000
    proc = subprocess.Popen(run_args(tmp_path, store, trainer__max_steps=steps, snapshot__every_steps=0), cwd=REPO,
                            env=env_of(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "run" / "metrics.jsonl", 3, proc)
    store.chmod(0o555)  # from now on the job cannot write there
    if how == "preempted":
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 74, err[-3000:]
    assert "could not be saved" in err and "no snapshot is committed yet: a restart begins at step 0" in err
    assert "saved; the same command resumes" not in err
    assert "Traceback" not in err
    assert not any(p.name.startswith("step_") for p in store.iterdir())
