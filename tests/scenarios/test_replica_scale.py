"""Survivors at scale: 16 replica groups of one process each (gpt-nano, one thread each), each its own
torchrun on loopback, all on this machine's cores, train 40 steps. One group's worker (the
coordinator's) is SIGKILLed at step 10: the 15 others go on from the step in flight, under the
successor (its torchrun restarts it, here too late to rejoin: a new interpreter on a sixteenth of the
cores takes longer than the run's last 30 steps). The run ends with the weights of the same 16
groups without the fault, bit for bit. (At 16 groups on 2
cores, epochs used to be formed again and again, each dropped for a member too slow to take it: not
one step trained in 12 minutes.)"""

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port_runs, make_corpus, records, torchrun_cmd, torchrun_env

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (CI: three groups, tests/scenarios/test_replica_groups.py)

GROUPS = 16
STEPS = 40
KILLED = 0  # the coordinator, and the member that logs and saves: its successor takes over
SECRET = secrets.token_hex(32)
CFG = ["model=gpt-nano", "data.block_size=32", "model.dropout=0.1", "trainer.batch_size=64",
       "trainer.micro_batch_size=1", "trainer.log_every=1", "trainer.eval_every=0", "trainer.progress=false",
       "trainer.threads=1", f"trainer.max_steps={STEPS}", "snapshot.every_steps=20"]


def run_job(tmp: Path, corpus: Path, kill: bool, extra: tuple = ()) -> Path:
    run_dir = tmp / "run"
    tmp.mkdir(parents=True, exist_ok=True)
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(GROUPS, 1)]
    logs = [tmp / f"group{g}.log" for g in range(GROUPS)]
    agents = [subprocess.Popen(torchrun_cmd(1, "mingpt/main.py", *CFG, f"data.path={corpus}",
                                            f"data.cache_dir={tmp.parent / 'cache'}", f"trainer.run_dir={run_dir}",
                                            f"replicas.peers=[{','.join(peers)}]", f"replicas.group={g}",
                                            *extra, max_restarts=2),
                               cwd=REPO, env=torchrun_env(MINGPT_JOB_SECRET=SECRET), stdout=logs[g].open("w"),
                               stderr=subprocess.STDOUT)
              for g in range(GROUPS)]
    try:
        if kill:
            deadline = time.time() + 600
            while not [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train" and r["step"] >= 10]:
                assert time.time() < deadline and all(a.poll() is None for a in agents), \
                    "\n".join(log.read_text()[-2000:] for log in logs[:3])
                time.sleep(0.1)
            worker = Path(f"/proc/{agents[KILLED].pid}/task/{agents[KILLED].pid}/children").read_text().split()
            os.kill(int(worker[0]), signal.SIGKILL)
        codes = [a.wait(timeout=900) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert codes == [0] * GROUPS, "\n".join(log.read_text()[-3000:] for log in logs)
    return run_dir


def trained(run_dir: Path) -> tuple[dict, dict]:
    """The final weights, and what each step was trained on: every share's (samples, sum of sample ids)."""
    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    assert manifest["step"] == STEPS
    shares = {r["step"]: [s[1:] for s in r["shares"]] for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train"}
    return state["model"], shares


@pytest.mark.parametrize("fan_out", [32, 3], ids=["every-member-hears-the-coordinator", "a-tree-of-relays"])
def test_sixteen_groups_lose_one_and_end_bitwise_equal_to_the_run_without_the_fault(tmp_path, fan_out):
    """With replicas.fan_out=3 the groups hear each other through a tree (each beacon hangs from one
    of fan_out + 1 members above it), and the killed group 0 is its root."""
    corpus = make_corpus(tmp_path)
    ref_weights, ref_shares = trained(run_job(tmp_path / "reference", corpus, kill=False))
    run_dir = run_job(tmp_path / "faulted", corpus, kill=True, extra=(f"replicas.fan_out={fan_out}",))
    weights, shares = trained(run_dir)
    epochs = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"]
    # the survivors went on without the killed group from the step in flight, the successor leading (after
    # the first epoch of all 16: one may form first without the slowest to start, and let them in at step 0)
    whole = next(i for i, e in enumerate(epochs) if len(e["members"]) == GROUPS)
    without = [e for e in epochs[whole:] if KILLED not in e["members"]]
    assert without and without[0]["members"] == [g for g in range(GROUPS) if g != KILLED], epochs
    assert 10 <= without[0]["step"] < STEPS, epochs
    # (the restarted process, started after the run's end, reads its last snapshot and trains nothing)
    assert not [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "resume" and r["step"] < STEPS], \
        "a snapshot was read"
    # every recorded step trained exactly the fault-free run's samples; a step is unrecorded only where an
    # epoch changed and the leader, behind, was healed past it (a known gap: the leader writes the records)
    assert shares == {k: ref_shares[k] for k in shares}
    boundaries = {e["step"] for e in epochs} | {e["step"] - 1 for e in epochs}
    assert set(ref_shares) - set(shares) <= boundaries, (sorted(set(ref_shares) - set(shares)), epochs)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
