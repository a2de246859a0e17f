"""Groups that were not in the launch (issue 66's stretch): `replicas.peers` lists the job's slots, 5
here, and fixes its shares (5 x k, whoever trains them); the job starts with 3 groups (a majority of
the slots), two more join while it trains and one of those leaves it for good. Every step is trained
on the samples of the run that only ever had the 3 groups, and the run ends with its weights, bit for
bit: the shares and the tree that sums them are the job's, not the groups'."""

import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port_runs, make_corpus, records
from test_replica_groups import final, launch, shares_by_step, wait_for_step

pytestmark = pytest.mark.slow

SLOTS = 5
LAUNCH = 3  # groups 0 to 2 start the job; 3 and 4 join it, and 4 leaves for good


def run(tmp: Path, corpus: Path, joining: bool) -> tuple[Path, list[Path], list[dict]]:
    run_dir = tmp / "run"
    tmp.mkdir(exist_ok=True)
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(SLOTS)]
    logs = [tmp / f"group{g}.log" for g in range(SLOTS)]
    agents = [launch(g, peers, corpus, run_dir, logs[g]) for g in range(LAUNCH)]
    events = []
    try:
        if joining:
            events.append({"step": wait_for_step(run_dir, 20, agents), "t": time.time(), "what": "join"})
            agents += [launch(g, peers, corpus, run_dir, logs[g]) for g in range(LAUNCH, SLOTS)]
            deadline = time.time() + 120
            while not [e for e in records(run_dir / "metrics.jsonl")
                       if e.get("kind") == "epoch" and e["members"] == list(range(SLOTS))]:
                assert time.time() < deadline and all(a.poll() is None for a in agents), \
                    "\n".join(log.read_text()[-3000:] for log in logs)
                time.sleep(0.05)
            step = wait_for_step(run_dir, max(r["step"] for r in records(run_dir / "metrics.jsonl")
                                               if r.get("kind") == "train") + 10, agents)
            # group 4 leaves for good: its torchrun is stopped (a node handed back), not restarted
            agents[4].send_signal(signal.SIGTERM)
            events.append({"step": step, "t": time.time(), "what": "leave"})
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert codes[:4] == [0] * min(4, len(codes)), "\n".join(log.read_text()[-3000:] for log in logs)
    return run_dir, logs, events


def test_two_groups_join_a_running_job_one_leaves_and_it_ends_as_the_launch_alone(tmp_path):
    corpus = make_corpus(tmp_path)
    ref_dir, _, _ = run(tmp_path / "reference", corpus, joining=False)
    run_dir, logs, (joined, left) = run(tmp_path / "joined", corpus, joining=True)
    recs = records(run_dir / "metrics.jsonl")
    epochs = [r for r in recs if r.get("kind") == "epoch"]
    # each newcomer joined the running job, healed from a member of it (no snapshot read: one run, no resume)
    for g in (3, 4):
        first = next(e for e in epochs if g in e["members"])
        assert first["step"] >= joined["step"] and g in first["healed"] and first["healed_from"] < LAUNCH, epochs
    assert not [r for r in recs if r.get("kind") == "resume"], "a snapshot was read"
    # group 4 left at a step boundary: the others formed an epoch without it, nothing dropped, nobody restarted
    after = [e for e in epochs if e["time"] >= left["t"]]
    assert [e["members"] for e in after] == [[0, 1, 2, 3]] and "group 4 left the job" in after[0]["why"], epochs
    assert "leaves the job after step" in logs[4].read_text(), logs[4].read_text()[-3000:]
    assert "on replica group 0 (3 of 5 groups)" in logs[0].read_text(), logs[0].read_text()[-3000:]
    for log in logs[:4]:
        text = log.read_text()
        assert text.count("training from step") == 1 and "trained again" not in text, text[-3000:]
    assert shares_by_step(run_dir) == shares_by_step(ref_dir)
    weights, expected = final(run_dir), final(ref_dir)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
