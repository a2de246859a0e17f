"""Real torchrun agents, real SIGKILL / SIGTERM, real snapshots: the job survives and ends exact."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, read_metrics, records, torchrun_cmd, torchrun_env

from benchmarks import alive
from benchmarks.soak import outlived
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest
from mingpt.training.metrics import read_records

pytestmark = pytest.mark.slow

MAX_STEPS = 120
CFG = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.block_size=64",
       "model.dropout=0.1", "trainer.batch_size=16", "trainer.micro_batch_size=4", "trainer.log_every=1",
       "trainer.eval_every=40", "trainer.progress=false", "optim.warmup_steps=10", f"trainer.max_steps={MAX_STEPS}"]


WIDE = ["model.n_embd=128"]
DOCS = ["data=shakespeare_speeches", "data.block_size=64", "data.documents.token_budget=256",
        "data.documents.micro_batches_per_step=3"]


def args(corpus, tmp_path, run_dir, every=10, docs=False):
    # documents are batched by data.documents.*: the block batch settings do not apply to them
    cfg = [c for c in CFG if not (docs and c.startswith(("trainer.batch_size", "trainer.micro_batch_size")))]
    return [*cfg, *(DOCS if docs else []), f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
            f"trainer.run_dir={run_dir}", f"snapshot.every_steps={every}"]


def final_weights(run_dir: Path, steps: int = MAX_STEPS) -> dict:
    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    assert manifest["step"] == steps
    return state["model"]


def wait_for_step(metrics: Path, step: int, proc, timeout=120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before the fault was injected"
        steps = [r.get("step", 0) for r in records(metrics)]
        if steps and max(steps) >= step:
            return max(steps)
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def workers_of(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the agent's worker processes, from /proc."""
    out = {}
    for pid in Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            out[int(rank)] = int(pid)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the same config: final weights and loss curve."""
    from conftest import make_corpus

    tmp = tmp_path_factory.mktemp("ref")
    corpus = make_corpus(tmp)
    run_dir = tmp / "run"
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *args(corpus, tmp, run_dir)), cwd=REPO,
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"corpus": corpus, "weights": final_weights(run_dir),
            "losses": {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items()}}


def test_sigkill_a_worker_torchrun_restarts_and_the_run_ends_bitwise_identical(reference, tmp_path):
    check_sigkill_recovery(reference, tmp_path, docs=False)


def test_documents_sigkill_recovery_is_exact_too(tmp_path):
    """Length-grouped document batches (uneven micro-batches over ranks) keep exact resume, here
    from a dataset made by mingpt-prepare, in many small shards (pieces cross shard boundaries), and
    over three ranks, where the order of a sum shows in its last bits ((a + b) + c is not a + (b + c);
    two ranks hide it): 128 wide, the gradients (1.7 MB) outgrow DDP's first bucket (1 MiB), so the
    buckets DDP rebuilds after its first step differ from that step's one bucket."""
    from conftest import make_docs_corpus

    raw = make_docs_corpus(tmp_path)
    corpus = tmp_path / "prepared"
    subprocess.run([sys.executable, "-m", "mingpt.cli.prepare", str(raw), "--out", str(corpus), "--tokenizer.kind=char",
                    "--separator", "\n\n", "--shard-mb", "0.002", "--unit-mb", "0.004"], cwd=REPO, check=True)
    assert len(json.loads((corpus / "manifest.json").read_text())["shards"]) > 5
    ref_dir = tmp_path / "ref"
    proc = subprocess.run(torchrun_cmd(3, "mingpt/main.py", *args(corpus, tmp_path, ref_dir, docs=True), *WIDE), cwd=REPO,
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = {"corpus": corpus, "weights": final_weights(ref_dir),
                 "losses": {s: r["loss"] for s, r in read_metrics(ref_dir / "metrics.jsonl").items()}}
    check_sigkill_recovery(reference, tmp_path / "faulty", docs=True, nproc=3, extra=WIDE)


@pytest.mark.long  # (the restart path: the DDP and FSDP SIGKILL tests; a split model's snapshot under every
# layout: test_tp_jobs and test_pipeline_jobs)
@pytest.mark.parametrize("nproc, split, shown", [
    (2, ["trainer.tensor_parallel=2"], "ddp x tensor parallel 2"),
    (8, ["trainer.pipeline_parallel=2", "trainer.parallel=fsdp", "trainer.tensor_parallel=2", "model.dropout=0",
         "trainer.eval_every=10"], "fsdp x tensor parallel 2 x pipeline 2 (1f1b)")],
                         ids=["tensor-parallel", "pipeline"])
def test_a_split_model_sigkill_recovery_is_exact_too(tmp_path, nproc, split, shown):
    """Processes splitting the model: each block (trainer.tensor_parallel=2; the snapshot gathered
    whole when saved, split again when loaded), or the blocks in two stages, each stage's blocks
    split over two processes by tensor parallelism and sharded over two such pairs by FSDP (8
    processes: trainer.pipeline_parallel=2, 1F1B; no dropout: a pipeline refuses it; each stage's
    processes resume their own parts, the tied matrix too; evaluated before each save).
    A worker SIGKILLed, torchrun restarts them all, and they resume into the run's exact course: final
    weights bitwise (read whole from the snapshot, as one process loads it), the loss curve equal; and
    mingpt-generate samples from the snapshot. 30 steps: a split model is slow on CPU."""
    from conftest import make_corpus

    extra = [*split, "trainer.max_steps=30"]
    corpus, ref_dir = make_corpus(tmp_path), tmp_path / "ref"
    proc = subprocess.run(torchrun_cmd(nproc, "mingpt/main.py", *args(corpus, tmp_path, ref_dir), *extra), cwd=REPO,
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"training from step 0 to 30 on {nproc} ranks ({shown})" in proc.stdout + proc.stderr
    reference = {"corpus": corpus, "weights": final_weights(ref_dir, 30),
                 "losses": {s: r["loss"] for s, r in read_metrics(ref_dir / "metrics.jsonl").items()}}
    check_sigkill_recovery(reference, tmp_path / "faulty", docs=False, nproc=nproc, extra=extra, kill_after=15, steps=30)
    sample = subprocess.run([sys.executable, "-m", "mingpt.cli.generate", str(tmp_path / "faulty" / "run"),
                             "--max-new-tokens", "20"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sample.returncode == 0 and len(sample.stdout.strip()) >= 20, sample.stderr[-3000:]


def check_sigkill_recovery(reference, tmp_path, docs, nproc=2, extra=(), kill_after=35, steps=MAX_STEPS):
    run_dir = tmp_path / "run"
    agent = subprocess.Popen(torchrun_cmd(nproc, "mingpt/main.py", *args(reference["corpus"], tmp_path, run_dir, docs=docs),
                                          *extra, max_restarts=3),
                             cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at = wait_for_step(run_dir / "metrics.jsonl", kill_after, agent)
    victim = workers_of(agent.pid)[1]
    os.kill(victim, signal.SIGKILL)
    out, _ = agent.communicate(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    records = read_records(run_dir / "metrics.jsonl")
    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == 1, out[-3000:]
    # resumed from the latest snapshot before the kill: at most one snapshot interval was lost
    assert killed_at - 10 <= resumes[0]["step"] <= killed_at and resumes[0]["step"] % 10 == 0
    assert "restart 1 here" in out
    weights = final_weights(run_dir, steps)
    for name, ref in reference["weights"].items():
        assert torch.equal(weights[name], ref), name
    losses = {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items()}
    assert losses == reference["losses"]  # the logged curve continues exactly


def test_sigterm_to_the_agent_saves_at_the_current_step_and_resume_is_exact(reference, tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(2, "mingpt/main.py", *args(reference["corpus"], tmp_path, run_dir, every=0))
    agent = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    signalled_at = wait_for_step(run_dir / "metrics.jsonl", 30, agent)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode != 0, "a preempted run must not look successful to the scheduler"
    assert "stopping on SIGTERM: snapshot of step" in out
    snaps = [s for s in SnapshotStore(str(run_dir / "snapshots")).list() if s.committed]
    assert len(snaps) == 1  # every_steps=0: this is the preemption snapshot
    stopped = snaps[0].step
    assert signalled_at <= stopped < MAX_STEPS and stopped <= signalled_at + 5
    # the scheduler starts the same command again: it resumes there and ends as if never stopped
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from snapshot step {stopped}" in proc.stderr
    weights = final_weights(run_dir)
    for name, ref in reference["weights"].items():
        assert torch.equal(weights[name], ref), name


def test_workers_die_with_a_sigkilled_agent_and_no_process_of_the_job_listens(reference, tmp_path):
    """torchrun starts workers in their own session; without PR_SET_PDEATHSIG they would be orphans.
    On a shared node nothing of the job may listen on a local socket another user can reach (the
    warm-restart server of earlier versions did, and outlived its agent), and nothing outlives the job."""
    run_dir = tmp_path / "run"
    long_run = [a for a in args(reference["corpus"], tmp_path, run_dir) if "max_steps" not in a]
    agent = subprocess.Popen(torchrun_cmd(2, "mingpt/main.py", *long_run, "trainer.max_steps=1000000"),
                             cwd=REPO, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_id = None
    try:
        wait_for_step(run_dir / "metrics.jsonl", 5, agent)
        workers = list(workers_of(agent.pid).values())
        assert len(workers) == 2
        run_id = next(e for e in Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
                      if e.startswith(b"TORCHELASTIC_RUN_ID="))
        job = processes_with(run_id)
        assert set(workers) <= set(job)
        assert unix_listeners(job) == [], "a process of the job listens on a unix socket"
        agent.kill()
        agent.wait()
        deadline = time.time() + 10
        while time.time() < deadline and alive(processes_with(run_id)):
            time.sleep(0.05)
        assert alive(processes_with(run_id)) == [], "processes of the job outlived their agent"
    finally:  # whatever failed, nothing of the job keeps running after the test
        agent.kill()
        agent.wait()
        for p in alive(processes_with(run_id)) if run_id else []:
            os.kill(p, signal.SIGKILL)


def test_under_plain_torchrun_the_mingpt_rendezvous_names_each_workers_agent(tmp_path):
    """`torchrun --rdzv_backend=mingpt` (no mingpt-torchrun) runs the same job: its workers are told their
    agent's pid too (the rendezvous handler runs in the agent), so one whose agent died while its
    interpreter started exits at once, also under a subreaper (mingpt/runtime/orphan.py)."""
    script = tmp_path / "worker.py"
    # one write each: the two workers share the agent's stdout, unbuffered (PYTHONUNBUFFERED), and
    # print's pieces interleaved ("agentagent  1:plain-run1:plain-run ...": 1 run in 3 failed)
    script.write_text("import os; os.write(1, ' '.join(['agent', str(os.environ.get('MINGPT_AGENT_PID')), "
                      "str(os.getppid()), os.environ['TORCHELASTIC_RUN_ID']]).encode() + b'\\n')\n")
    env = torchrun_env(MINGPT_JOB_SECRET=secrets.token_hex(32))
    env.pop("MINGPT_AGENT_PID", None)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                              "--rdzv_backend=mingpt", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                              "--rdzv_id=plain-run", str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-3000:]
    said = [line.split()[1:] for line in out.splitlines() if line.startswith("agent ")]
    assert said == [[f"{agent.pid}:plain-run", str(agent.pid), "plain-run"]] * 2


def test_workers_of_an_agent_killed_while_they_start_die_too(reference, tmp_path):
    """The agent SIGKILLed while its workers are still importing (a scheduler killing a job that
    was just relaunched): before, PR_SET_PDEATHSIG was armed only after seconds of imports, so such
    workers lived on as orphans and trained beside the job's next attempt, into the same store."""
    run_dir = tmp_path / "run"
    long_run = [a for a in args(reference["corpus"], tmp_path, run_dir) if "max_steps" not in a]
    for attempt in range(3):
        agent = subprocess.Popen(torchrun_cmd(2, "mingpt/main.py", *long_run, "trainer.max_steps=1000000"),
                                 cwd=REPO, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        workers = {}
        try:
            deadline = time.time() + 60
            while len(workers) < 2 and time.time() < deadline:
                try:
                    workers = workers_of(agent.pid)
                except OSError:  # a child between fork and exec
                    pass
                time.sleep(0.005)
            assert len(workers) == 2, "the workers never started"
            time.sleep(0.3 * attempt)  # early in their start, and a little later
            agent.kill()
            agent.wait()
            assert outlived(list(workers.values()), wait_s=10) == 0, f"attempt {attempt}: workers outlived their agent"
        finally:
            agent.kill()
            agent.wait()
            for p in alive(list(workers.values())):
                os.kill(p, signal.SIGKILL)


def test_a_launcher_as_pid_1_is_not_taken_for_a_dead_agent():
    """torchrun as a container's entry point (the Dockerfile's) is PID 1: its workers' parent is 1
    and they must not take themselves for orphans; any other PID 1 (an init) means the agent died."""
    from mingpt.runtime.orphan import _is_launcher

    for argv0, launcher in (("/usr/local/bin/torchrun", True), ("/usr/bin/mingpt-torchrun", True),
                            ("/sbin/init", False), ("tini", False)):
        proc = subprocess.Popen(["bash", "-c", f"exec -a {argv0} sleep 30"])
        try:
            deadline = time.time() + 10
            while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(argv0.encode()):
                assert time.time() < deadline
                time.sleep(0.01)
            assert _is_launcher(proc.pid) is launcher, argv0
        finally:
            proc.kill()
            proc.wait()
    python_m = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "torch.distributed.run"])
    try:
        time.sleep(0.2)
        assert _is_launcher(python_m.pid)  # `python -m torch.distributed.run ...`
    finally:
        python_m.kill()
        python_m.wait()


def processes_with(env_entry: bytes) -> list[int]:
    """The processes whose environment holds env_entry (this job's TORCHELASTIC_RUN_ID=...)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if env_entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(int(pid))
        except OSError:
            continue
    return out


def unix_listeners(pids: list[int]) -> list[str]:
    """The listening unix sockets (abstract or file) that these processes hold."""
    listening = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if int(parts[3], 16) & 0x10000:  # __SO_ACCEPTCON: a listening socket
            listening[parts[6]] = parts[7] if len(parts) > 7 else "?"
    held = []
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in listening:
                    held.append(f"pid {pid}: {listening[target[8:-1]]}")
        except OSError:
            continue
    return held


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=pytest.mark.long)])
def test_fsdp_sigkill_resumes_bitwise_and_loads_at_one_rank_under_ddp(tmp_path, optimizer):
    """FSDP2 at 2 ranks: a SIGKILLed worker resumes under FSDP at 2 ranks bitwise equal to the
    uninterrupted run; the same run's snapshot continues at 1 rank under DDP within a tolerance: one
    rank sums each step's micro-batches in another order (float addition is not associative), and
    the shorter last step of an epoch is cut into other micro-batches, so dropout draws other noise
    there. The first step after the resume shows that the state itself loaded exactly. The same with
    Muon: its momentum, sharded by FSDP, saved, resumed and resharded as AdamW's moments are."""
    from conftest import make_corpus

    corpus = make_corpus(tmp_path)
    fsdp = ["trainer.parallel=fsdp", f"trainer.optimizer={optimizer}"]
    ref_dir = tmp_path / "ref"
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *args(corpus, tmp_path, ref_dir), *fsdp), cwd=REPO,
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = {"corpus": corpus, "weights": final_weights(ref_dir),
                 "losses": {s: r["loss"] for s, r in read_metrics(ref_dir / "metrics.jsonl").items()}}
    faulty = tmp_path / "faulty"
    run_dir = faulty / "run"
    agent = subprocess.Popen(torchrun_cmd(2, "mingpt/main.py", *args(corpus, faulty, run_dir), *fsdp, max_restarts=3),
                             cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(run_dir / "metrics.jsonl", 35, agent)
    os.kill(workers_of(agent.pid)[1], signal.SIGKILL)
    out, _ = agent.communicate(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    assert "restart 1 here" in out and "saved by 2 ranks with fsdp, now 2 with fsdp" in out
    weights = final_weights(run_dir)
    for name, ref in reference["weights"].items():
        assert torch.equal(weights[name], ref), name
    # a snapshot of 2 FSDP writers, continued by one process (DDP's strategy at world size 1)
    store = SnapshotStore(str(run_dir / "snapshots"))
    start = [s for s in store.list() if s.committed][0]
    assert store.read_manifest(start.path)["files"].keys() >= {"shard-00000-of-00002.bin", "shard-00001-of-00002.bin"}
    one_dir = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "mingpt.main", *args(corpus, tmp_path, one_dir), "trainer.parallel=ddp",
                           f"trainer.optimizer={optimizer}", f"snapshot.resume={start.path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from snapshot step {start.step}" in proc.stderr and "now 1 with single" in proc.stderr
    weights = final_weights(one_dir)
    for name, ref in reference["weights"].items():
        torch.testing.assert_close(weights[name], ref, rtol=0, atol=1e-3, msg=name)  # about 2 AdamW steps
    losses = {s: r["loss"] for s, r in read_metrics(one_dir / "metrics.jsonl").items()}
    assert abs(losses[start.step + 1] - reference["losses"][start.step + 1]) < 1e-6
    # the curves part by noise after the epoch's last step (other dropout draws): 5.2e-3 at most with
    # the initial values drawn since 2026-11-25 (the bound was 5e-3 before), so the bound is 1e-2
    assert max(abs(losses[s] - reference["losses"][s]) for s in losses) < 1e-2


def test_a_damaged_or_missing_shard_makes_every_rank_fall_back_together(tmp_path):
    """2 ranks: the newest snapshot has a shard with one byte changed (found by the ranks' checksums
    while loading), the one before it lacks a shard (found by rank 0's listing); both ranks pass over
    both, with warnings naming the shards, and resume from the third."""
    from conftest import make_corpus

    corpus = make_corpus(tmp_path)
    run_dir = tmp_path / "run"
    base = [a for a in args(corpus, tmp_path, run_dir) if "max_steps" not in a]
    cmd = torchrun_cmd(2, "mingpt/main.py", *base, "trainer.max_steps=30")
    proc = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    snaps = run_dir / "snapshots"
    damaged = snaps / "step_000000030" / "shard-00001-of-00002.bin"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    (snaps / "step_000000020" / "shard-00000-of-00002.bin").unlink()
    proc = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *base, "trainer.max_steps=40"), cwd=REPO,
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step_000000020 cannot be loaded (shard-00000-of-00002.bin is missing)" in out
    assert "shard shard-00001-of-00002.bin fails its checksum" in out and "step_000000030 cannot be loaded" in out
    assert "resumed from snapshot step 10" in out
    assert json.loads((snaps / "step_000000040" / "manifest.json").read_text())["step"] == 40
