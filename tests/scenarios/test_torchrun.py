"""Real torchrun processes (gloo on CPU)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    SMALL,
    bpe_overrides,
    dataset_files,
    free_port,
    gpt2_ranks,
    make_docs_corpus,
    read_metrics,
    records,
    snapshots,
    torchrun_cmd,
    torchrun_env,
)

from mingpt.data.prepare import prepare
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

pytestmark = pytest.mark.slow

TINY = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.block_size=32",
        "optim.warmup_steps=5", "trainer.log_every=5", "trainer.progress=false"]


def common(corpus, tmp_path):
    return [f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]


def run(cmd, timeout=240):
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def test_two_process_run_learns_snapshots_and_resumes(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, *common(corpus_file, tmp_path), f"trainer.run_dir={run_dir}", "trainer.batch_size=16",
            "trainer.micro_batch_size=4", "trainer.eval_every=20", "snapshot.every_steps=20"]
    log = run(torchrun_cmd(2, "mingpt/main.py", *args, "trainer.max_steps=40"))
    assert "[rank 0/2]" in log and "[rank 1/2] INFO" not in log  # one logger
    train = read_metrics(run_dir / "metrics.jsonl")
    assert train[40]["loss"] < train[5]["loss"] - 0.5
    assert train[40]["world_size"] == 2
    # straggler figures: each rank's compute time before the gradient all-reduce
    assert len(train[40]["compute_ms"]) == 2 and all(c > 0 for c in train[40]["compute_ms"])
    assert train[40]["compute_max_median"] >= 1.0 and train[40]["slowest"].endswith((":0", ":1"))
    evals = read_metrics(run_dir / "metrics.jsonl", "eval")
    assert evals[40]["val_loss"] < evals[20]["val_loss"]
    snaps = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert snaps == ["step_000000020", "step_000000040"]

    # the same command with a higher max_steps resumes at 40, it does not start over
    log = run(torchrun_cmd(2, "mingpt/main.py", *args, "trainer.max_steps=50"))
    assert "resumed from snapshot step 40" in log
    train = read_metrics(run_dir / "metrics.jsonl")
    assert max(train) == 50 and 45 in train

    out = subprocess.run([sys.executable, "-m", "mingpt.cli.generate", str(run_dir / "snapshots"), "--prompt",
                          "Speaker", "--max-new-tokens", "30"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Speaker") and len(out.stdout.strip()) >= 30


@pytest.mark.long  # (CI: every 2-process job of the suite ends through the same exit, and checks its code)
def test_a_finished_job_never_ends_in_sigabrt(corpus_file, tmp_path):
    """The shortest 2-process job (one step, then exit), started again and again: before the fix, about
    one launch in six died of SIGABRT at exit ("terminate called without an active exception")."""
    args = [*TINY, *common(corpus_file, tmp_path), "trainer.batch_size=8", "trainer.micro_batch_size=4",
            "snapshot.resume=never"]
    for i in range(6):
        out = run(torchrun_cmd(2, "tests/scenarios/grad_worker.py", str(tmp_path / "g.pt"), *args,
                               f"trainer.run_dir={tmp_path / str(i)}"), timeout=120)
        assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]


def test_an_error_under_torchrun_is_printed_once_and_is_torchruns_root_cause(corpus_file, tmp_path):
    """Every rank meets the error; rank 0 prints it (the others wait for it, since torchrun stops the
    job at the first exit: before, rank 1 sometimes exited first and the line was never printed)."""
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *TINY, *common(corpus_file, tmp_path), "model.n_head=3",
                                       f"trainer.run_dir={tmp_path / 'run'}"),
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = "model.n_embd=32 is not divisible by model.n_head=3; choose n_embd as a multiple of n_head"
    assert len([line for line in out.splitlines() if line.endswith(message) and "ERROR" in line]) == 1, out
    root_cause = out.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {message}" in root_cause and "error_file: <N/A>" not in root_cause
    # (the other rank may show as SIGTERMed: torchrun stops the rest of the workers after the first failure)
    assert "Error executing job" not in out


@pytest.mark.parametrize("batch, micro, parallel, ac", [(5, 2, "ddp", False), (5, 2, "fsdp", True)],
                         ids=["uneven", "uneven-fsdp-activation-checkpointing"])
def test_two_processes_give_the_same_gradients_as_one(corpus_file, tmp_path, batch, micro, parallel, ac):
    """(FSDP with activation checkpointing, against one process without it: the same gradients.)"""
    args = [*TINY, *common(corpus_file, tmp_path), f"trainer.batch_size={batch}", f"trainer.micro_batch_size={micro}",
            "snapshot.resume=never", f"trainer.parallel={parallel}"]
    one, two = tmp_path / "g1.pt", tmp_path / "g2.pt"
    run([sys.executable, "tests/scenarios/grad_worker.py", str(one), *args, f"trainer.run_dir={tmp_path / 'a'}"])
    log = run(torchrun_cmd(2, "tests/scenarios/grad_worker.py", str(two), *args, f"trainer.run_dir={tmp_path / 'b'}",
                           f"trainer.activation_checkpointing={ac}"))
    assert ac == ("activation checkpointing" in log)
    g1, g2 = torch.load(one), torch.load(two)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in g1.values()) > 1e-3  # real, non-zero gradients


@pytest.mark.parametrize("tp", [1, 2], ids=["ddp", "tensor-parallel-activation-checkpointing"])
def test_documents_two_processes_give_the_same_gradients_as_one(tmp_path, tp):
    """Length-grouped document batches, 3 micro-batches per step over 2 ranks: uneven token counts.
    Under tensor parallelism the 2 processes split each block and each sequence, whose lengths
    (of any parity here) the group pads to a multiple of 2 and cuts back; they checkpoint activations
    too (one process does not)."""
    corpus = make_docs_corpus(tmp_path)
    args = [*TINY, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data=shakespeare_speeches",
            "data.block_size=32", "data.documents.token_budget=128", "data.documents.micro_batches_per_step=3",
            "snapshot.resume=never"]
    one, two = tmp_path / "g1.pt", tmp_path / "g2.pt"
    run([sys.executable, "tests/scenarios/grad_worker.py", str(one), *args, f"trainer.run_dir={tmp_path / 'a'}"])
    log = run(torchrun_cmd(2, "tests/scenarios/grad_worker.py", str(two), *args, f"trainer.run_dir={tmp_path / 'b'}",
                           f"trainer.tensor_parallel={tp}", f"trainer.activation_checkpointing={tp > 1}"))
    assert "length_grouped batching" in log and (tp == 1 or "ddp x tensor parallel 2" in log)
    assert (tp > 1) == ("activation checkpointing" in log)
    g1, g2 = torch.load(one), torch.load(two)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in g1.values()) > 1e-3


LAUNCH = [sys.executable, "-m", "mingpt.cli.launch", "--standalone", "--nproc_per_node=2", "--max-restarts=3"]


@pytest.mark.parametrize("bad, message", [
    ("trainer.max_stepz=4", "unknown config key trainer.max_stepz (did you mean trainer.max_steps?)"),
    ("data.path=/nonexistent/corpus.txt", "corpus file /nonexistent/corpus.txt does not exist"),
])
def test_a_bad_setting_under_the_readmes_launcher_is_one_line_exit_2_and_never_retried(tmp_path, bad, message):
    """Plain torchrun: exit 1, about 45 lines of its own, and the bad config attempted 4 times under
    --max-restarts=3. The README's launcher: our one line, exit 2, one attempt; a setting of the config
    is refused by the launcher itself, before any worker starts (a worker first imports torch)."""
    proc = subprocess.run([*LAUNCH, "mingpt/main.py", *TINY, f"trainer.run_dir={tmp_path / 'run'}", bad], cwd=REPO,
                          env={**torchrun_env(), "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    if bad.startswith("trainer."):  # the launcher's one line; no worker started
        assert lines == [f"mingpt-torchrun: {message}; `python -m mingpt.main --cfg job` lists every key"], out
        return
    assert len([line for line in lines if " ERROR " in line]) == 1 and message in out, out
    assert all(re.match(r"\d\d:\d\d:\d\d \S+:\d \[rank ", line) for line in lines), out  # our log lines only


@pytest.mark.slow
def test_a_second_launch_with_the_same_rendezvous_id_is_refused_and_a_torchrun_restart_resumes(corpus_file, tmp_path):
    """The documented command twice (--rdzv_id=run1, snapshot.resume=never): the second launch is
    refused; a worker SIGKILLed in the first one is restarted by torchrun and resumes its own run."""
    run_dir = tmp_path / "run"

    def launch(launch_id: str, **kw):  # the launch id mingpt-torchrun derives from a new job secret
        cmd = [*torchrun_cmd_c10d(), "mingpt/main.py", *TINY, f"data.path={corpus_file}", "snapshot.every_steps=5",
               f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}", "trainer.max_steps=200",
               "trainer.log_every=1", "snapshot.resume=never"]
        log = tmp_path / f"{launch_id}.log"  # a file: a pipe read only at the end can fill and stop the job
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(MINGPT_LAUNCH_ID=launch_id), text=True,
                                    stdout=fh, stderr=subprocess.STDOUT, **kw)
        return proc, log

    first, log = launch("launch-1")
    # the SIGKILL lands once a snapshot has committed (steps are a few ms and the commit is in the
    # background: a kill at step 6 once came before step 5's commit, and the restart began anew) and
    # while the first attempt trains (200 steps: at 40 it had once finished)
    while not any(r.get("kind") == "snapshot" and r.get("status") == "committed"
                  for r in records(run_dir / "metrics.jsonl")):
        assert first.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    worker = int(Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()[0])
    os.kill(worker, signal.SIGKILL)
    first.wait(timeout=300)
    out = log.read_text()
    assert first.returncode == 0, out[-3000:]
    resumes = [r for r in records(run_dir / "metrics.jsonl") if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 5, out[-3000:]
    before = snapshots(run_dir)
    assert max(before) == 200 and len(set(before.values())) == 1
    second, log = launch("launch-2")
    second.wait(timeout=300)
    out = log.read_text()
    assert second.returncode != 0 and "holds snapshots of another run" in out, out[-3000:]
    assert snapshots(run_dir) == before


def torchrun_cmd_c10d() -> list[str]:
    """torchrun as the docs launch it: a c10d rendezvous named run1, one worker, one restart allowed."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1", "--max-restarts=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=run1"]


@pytest.mark.slow
def test_ranks_under_torchrun_prepare_one_dataset_together(inputs, tmp_path):
    from conftest import REPO, torchrun_cmd, torchrun_env

    prepare([str(inputs)], str(tmp_path / "one"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    proc = subprocess.run(torchrun_cmd(2, "-m", "mingpt.cli.prepare", str(inputs), "--out", str(tmp_path / "two"),
                                       "--tokenizer.ranks_file", gpt2_ranks(), "--unit-mb", str(SMALL.unit_bytes / 2**20),
                                       "--shard-mb", str(SMALL.shard_bytes / 2**20)),
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert dataset_files(tmp_path / "one") == dataset_files(tmp_path / "two")
    assert proc.stdout.count("1,151 documents") == 1  # one summary, from rank 0


transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")


def test_a_few_finetuning_steps_under_torchrun(hf_dir, corpus_file, tmp_path):
    path, _ = hf_dir
    run_dir = tmp_path / "run"
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *bpe_overrides(corpus_file, tmp_path, run_dir),
                                       f"model.init_from={path}", "trainer.max_steps=4", "trainer.log_every=2"),
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stderr and "model shape from" in proc.stderr
    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    assert manifest["step"] == 4 and manifest["model_shape"]["n_layer"] == 2


def test_a_restart_under_the_readmes_launcher_is_one_line_and_never_called_a_preemption(corpus_file, tmp_path):
    """mingpt-torchrun quiets torchrun's own lines: its restart used to be 60 s of silence, then a
    start line; and the workers it stopped said "stopping on SIGTERM ... the same command resumes",
    though nobody need act. Now the agent says why it restarts, and the survivors that saved say that
    torchrun restarts them."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "mingpt/main.py", *TINY, *common(corpus_file, tmp_path), f"trainer.run_dir={run_dir}",
           "trainer.max_steps=150", "snapshot.every_steps=5"]
    log = tmp_path / "job.log"
    with open(log, "w") as fh:
        job = subprocess.Popen(cmd, cwd=REPO, env={**torchrun_env(), "PYTHONUNBUFFERED": "1"}, stdout=fh,
                               stderr=subprocess.STDOUT, text=True)
    try:
        while not any(r.get("kind") == "snapshot" and r.get("status") == "committed"
                      for r in records(run_dir / "metrics.jsonl")):
            assert job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        workers = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
        os.kill(int(workers[-1]), signal.SIGKILL)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    out = log.read_text()
    assert re.search(r"mingpt-torchrun: worker [01] was killed by SIGKILL: restarting the workers on \S+ "
                     r"\(0 restarts left\)", out), out[-3000:]
    assert "the same command resumes" not in out and "stopping on SIGTERM" not in out, out[-3000:]
    assert "torch.distributed" not in out and "Traceback" not in out, out[-3000:]
