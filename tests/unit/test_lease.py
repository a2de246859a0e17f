"""One live job per snapshot store: the store's lease, on local disk and on S3, with real processes."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, records

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.lease import LEASE_FILE, Lease, LeaseError

# A process that holds the lease of the store argv[1] for launch argv[2], with a TTL of argv[3] s.
# (and of job argv[4], if given)
HOLDER = ("import sys, time; from mingpt.snapshot import SnapshotStore; from mingpt.snapshot.lease import Lease; "
          "Lease(SnapshotStore(sys.argv[1]), sys.argv[2], float(sys.argv[3]), **({'job': sys.argv[4]} if sys.argv[4:] "
          "else {})).take(); print('held', flush=True); time.sleep(600)")


def holder(store_url: str, launch_id: str, ttl_s: float, *job: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, store_url, launch_id, str(ttl_s), *job], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_live_lease_refuses_another_launch_and_the_same_launch_takes_it_over(store_url):
    store = SnapshotStore(store_url)
    first = Lease(store, "launch-a", 30).take()
    with pytest.raises(LeaseError) as err:
        Lease(store, "launch-b", 30).take()
    assert (f"snapshot store {store.url} is in use by job launch-a on host {socket.gethostname()} (pid {os.getpid()}) "
            "since ") in str(err.value)
    assert str(err.value).endswith("; wait for it, or use another trainer.run_dir / snapshot.dir; a dead job's "
                                   "lease expires after 30 s")
    restart = Lease(store, "launch-a", 30).take()  # a torchrun restart of the same launch does not wait
    first.release()  # the replaced holder's release leaves the restart's lease alone
    with pytest.raises(LeaseError):
        Lease(store, "launch-b", 30).take()
    restart.release()
    Lease(store, "launch-b", 30).take().release()
    assert not store.files.exists(f"{store.root}/{LEASE_FILE}")


def test_a_killed_holders_lease_is_taken_over_and_a_stopped_ones_expires(store_url, caplog):
    store = SnapshotStore(store_url)
    killed = holder(store_url, "launch-a", 30)
    with pytest.raises(LeaseError):
        Lease(store, "launch-b", 30).take()
    killed.kill()
    killed.wait()
    with caplog.at_level(logging.WARNING):  # its process is gone (this host): no need to wait 30 s
        Lease(store, "launch-b", 30).take().release()
    assert "taking over the lease of job launch-a" in caplog.text and "whose process is gone" in caplog.text
    stopped = holder(store_url, "launch-c", 1.0)  # alive, but it renews no more (a hung or cut-off node)
    try:
        with pytest.raises(LeaseError, match="expires after 1 s"):
            Lease(store, "launch-d", 30).take()
        stopped.send_signal(signal.SIGSTOP)
        expires = json.loads(store.files.get(f"{store.root}/{LEASE_FILE}"))["expires"]
        time.sleep(max(0.0, expires - time.time()) + 0.1)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            Lease(store, "launch-d", 30).take().release()
        assert "taking over the lease of job launch-c" in caplog.text
        assert "which it did not renew in time" in caplog.text
    finally:
        stopped.kill()
        stopped.wait()


def test_a_holder_whose_launch_took_the_lease_over_while_it_runs_is_told_and_a_shared_lease_is_not(store_url, caplog):
    """Two worlds of one launch (a node that torchrun's rendezvous left behind formed its own): the
    one whose lease was taken over learns it at its next renewal and stops renewing; replica groups,
    which share the lease, are not told."""
    store = SnapshotStore(store_url)
    told, told_shared = [], []
    with caplog.at_level(logging.ERROR):
        behind = Lease(store, "launch-a", 0.4, on_superseded=lambda: told.append(1)).take()  # renews every 0.1 s
        ahead = Lease(store, "launch-a", 30).take()
        deadline = time.time() + 10
        while not told and time.time() < deadline:
            time.sleep(0.05)
    assert len(told) == 1
    assert (f"another world of this job (launch launch-a) took over snapshot store {store.url} while this one runs "
            f"(host {socket.gethostname()}, pid {os.getpid()})") in caplog.text
    time.sleep(0.3)
    assert len(told) == 1  # told once; it renews no more, so the lease stays the other world's
    assert json.loads(store.files.get(f"{store.root}/{LEASE_FILE}"))["token"] == ahead.record["token"]
    behind.release()
    ahead.release()
    one = Lease(store, "launch-s", 0.4, shared=True, on_superseded=lambda: told_shared.append(1)).take()
    other = Lease(store, "launch-s", 0.4, shared=True, on_superseded=lambda: told_shared.append(1)).take()
    time.sleep(0.6)  # both renew, each over the other's record
    one.release()
    other.release()
    assert told_shared == []


def test_the_world_that_took_the_lease_over_keeps_it_when_the_others_renewal_raced_the_take_over(store_url, caplog):
    """The world left behind read the lease just before the other took it over, and wrote its renewal
    just after. Before: the world that took over found the older one's record at its next look, took
    itself for the one left behind and stopped, and the older one trained on (a CI run waited 120 s
    for it to stop). Now the later one writes its own again and the older one stops."""
    store = SnapshotStore(store_url)
    told = {"behind": 0, "ahead": 0}
    behind = Lease(store, "launch-a", 30, on_superseded=lambda: told.update(behind=told["behind"] + 1)).take()
    ahead = Lease(store, "launch-a", 30, on_superseded=lambda: told.update(ahead=told["ahead"] + 1)).take()
    behind._write()  # its renewal, which had read its own record before the take-over
    with caplog.at_level(logging.ERROR):
        assert ahead.check() is True
        assert behind.check() is False
        assert ahead.check() is True
    assert told == {"behind": 1, "ahead": 0}
    assert json.loads(store.files.get(f"{store.root}/{LEASE_FILE}"))["token"] == ahead.record["token"]
    assert caplog.text.count("another world of this job (launch launch-a) took over") == 1
    behind.release()
    ahead.release()
    assert not store.files.exists(f"{store.root}/{LEASE_FILE}")


def test_another_launch_of_the_same_job_waits_the_old_lease_out_and_is_refused_if_it_is_renewed(store_url, caplog):
    """A SLURM requeue after a node loss (same secret, so same job; a new launch) waits out the dead
    attempt's lease instead of exiting 2; a second live launch with the same secret is refused."""
    store = SnapshotStore(store_url)
    live = holder(store_url, "launch-a", 2.0, "job-1")  # renews every 0.5 s
    try:
        t0 = time.time()
        with pytest.raises(LeaseError, match=r"in use by job launch-a \(another launch of this job, live"):
            Lease(store, "launch-b", 30, job="job-1").take()
        assert time.time() - t0 < 2.0  # refused at its first renewal, not once the TTL is over
        with pytest.raises(LeaseError):  # another job's launch: refused at once, as before
            Lease(store, "launch-b", 30, job="job-2").take()
        live.send_signal(signal.SIGSTOP)  # its node is lost: it renews no more, its process is not gone
        with caplog.at_level(logging.WARNING):
            Lease(store, "launch-b", 30, job="job-1").take().release()
        assert "another launch of this job (launch-a" in caplog.text and "waiting up to" in caplog.text
        assert "which it did not renew in time" in caplog.text
    finally:
        live.kill()
        live.wait()


def test_a_holder_whose_lease_another_launch_took_over_commits_nothing_and_says_so_once(tmp_path):
    """Frozen past lease_s, then taken over: it checks the lease before each commit (and at each
    renewal) and stops through on_lost, instead of logging "two jobs now write there" and saving on."""
    from mingpt.snapshot.snapshotter import Snapshotter

    store = SnapshotStore(str(tmp_path / "snapshots"))
    lost = []
    lease = Lease(store, "launch-a", 30, on_lost=lost.append).take()
    snapshotter = Snapshotter(store, guard=lease.check)
    snapshotter.save(5, [], {"step": 5}, {"step": 5})
    assert snapshotter.wait() is True and [s.step for s in store.list() if s.committed] == [5]
    store.files.put(f"{store.root}/{LEASE_FILE}", json.dumps({**lease.record, "launch_id": "launch-b", "token": "t",
                                                               "expires": time.time() + 30}).encode())
    snapshotter.save(10, [], {"step": 10}, {"step": 10})
    assert snapshotter.wait() is False and [s.step for s in store.list() if s.committed] == [5]
    assert lease.check() is False  # the renewing thread's next look: told once only
    snapshotter.close()
    lease.release()
    assert len(lost) == 1 and lost[0].startswith(f"the lease of snapshot store {store.url} was taken over by job "
                                                 "launch-b on host ")
    assert "stopping without saving" in lost[0]
    assert json.loads(store.files.get(f"{store.root}/{LEASE_FILE}"))["launch_id"] == "launch-b"  # left to it


TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.log_every=1",
        "trainer.progress=false", "snapshot.every_steps=5"]


def test_a_second_job_in_the_same_run_directory_is_refused_in_one_line(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "mingpt.main", *TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'c'}",
            f"trainer.run_dir={run_dir}"]
    log = tmp_path / "first.log"  # a file, not a pipe: a pipe nobody reads fills up and stops the job's logging
    with open(log, "w") as fh:
        first = subprocess.Popen([*args, "trainer.max_steps=1000000"], cwd=REPO, stderr=fh, text=True)
    try:
        while not any(r.get("kind") == "train" for r in records(run_dir / "metrics.jsonl")):
            assert first.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        second = subprocess.run([*args, "trainer.max_steps=10"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
        assert len(errors) == 1 and f"snapshot store {run_dir / 'snapshots'} is in use by job " in errors[0], errors
        assert f"(pid {first.pid})" in errors[0]
        assert [r["kind"] for r in records(run_dir / "metrics.jsonl")].count("start") == 1  # nothing of the second
        first.send_signal(signal.SIGTERM)  # stops after a snapshot, and gives the store back
        assert first.wait(timeout=300) == 75, log.read_text()[-3000:]
    finally:
        first.kill()
        first.wait()
    assert not (run_dir / "snapshots" / LEASE_FILE).exists()
    done = subprocess.run([*args, "trainer.max_steps=10"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_world_that_another_world_of_its_launch_superseded_ends_and_the_other_trains_on(corpus_file, tmp_path):
    """A split brain of torchrun's rendezvous, played by two processes of one launch id in one run
    directory: the one started second takes the store over (as a restart does) and the first, still
    training, ends within a renewal with one line and exit 1 (torchrun restarts it to rejoin), instead
    of both writing snapshots into one store."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "mingpt.main", *TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'c'}",
            f"trainer.run_dir={run_dir}", "snapshot.lease_s=1"]
    env = {**os.environ, "MINGPT_LAUNCH_ID": "one-launch"}
    log = tmp_path / "first.log"
    with open(log, "w") as fh:
        first = subprocess.Popen([*args, "trainer.max_steps=1000000"], cwd=REPO, env=env, stderr=fh, text=True)
    try:
        while not any(r.get("kind") == "train" and r["step"] >= 5 for r in records(run_dir / "metrics.jsonl")):
            assert first.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        with open(tmp_path / "second.log", "w") as fh:
            second = subprocess.Popen([*args, "trainer.max_steps=1000000"], cwd=REPO, env=env, stderr=fh, text=True)
        assert first.wait(timeout=120) == 1, log.read_text()[-3000:]
        time.sleep(2)  # the second trains on, alone
        assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 75, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        for p in (first, *([second] if "second" in locals() else [])):
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = [line for line in log.read_text().splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, errors
    assert ("another world of this job (launch one-launch) took over snapshot store " f"{run_dir / 'snapshots'}"
            in errors[0]) and errors[0].endswith("stopping this world so that its node rejoins the other"), errors
    second_log = (tmp_path / "second.log").read_text()
    assert "ERROR" not in second_log and "Traceback" not in second_log, second_log[-3000:]
    # the second resumed once (from the first's snapshot); the first never resumed anything
    resumed = [r["step"] for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "resume"]
    assert len(resumed) == 1
    assert not (run_dir / "snapshots" / LEASE_FILE).exists()


def test_a_job_frozen_past_its_lease_and_taken_over_stops_in_one_line_with_exit_77(corpus_file, tmp_path):
    """Before: it logged "two jobs now write there" and went on saving, and the two jobs committed
    and pruned each other's snapshots."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "mingpt.main", *TINY, f"data.path={corpus_file}", f"data.cache_dir={tmp_path / 'c'}",
            f"trainer.run_dir={run_dir}", "snapshot.lease_s=1", "trainer.max_steps=1000000"]
    lease_file = run_dir / "snapshots" / LEASE_FILE
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    procs = []
    try:
        with open(logs[0], "w") as fh:
            procs.append(subprocess.Popen(args, cwd=REPO, env={**os.environ, "MINGPT_LAUNCH_ID": "launch-1"},
                                          stderr=fh, text=True))
        while not any(r.get("kind") == "snapshot" for r in records(run_dir / "metrics.jsonl")):
            assert procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGSTOP)  # frozen (a hung node, a suspended VM) past its lease
        time.sleep(max(0.0, json.loads(lease_file.read_text())["expires"] - time.time()) + 0.2)
        with open(logs[1], "w") as fh:
            procs.append(subprocess.Popen(args, cwd=REPO, env={**os.environ, "MINGPT_LAUNCH_ID": "launch-2"},
                                          stderr=fh, text=True))
        while not (lease_file.exists() and json.loads(lease_file.read_text())["launch_id"] == "launch-2"):
            assert procs[1].poll() is None, logs[1].read_text()[-3000:]
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGCONT)
        assert procs[0].wait(timeout=60) == 77, logs[0].read_text()[-3000:]
        time.sleep(1)  # the second trains on, alone
        assert procs[1].poll() is None, logs[1].read_text()[-3000:]
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=120) == 75, logs[1].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    errors = [line for line in logs[0].read_text().splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1 and "was taken over by job launch-2" in errors[0], errors
    assert "stopping without saving" in errors[0]
