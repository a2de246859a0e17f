"""Goodput accounting and `python -m mingpt.report`: from records, and from a real SIGKILLed run."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, make_corpus, records, torchrun_cmd, torchrun_env

from mingpt.report.goodput import CATEGORIES, account
from mingpt.training.ledger import STATES


def ledger(t0, step, kind="time", job="j1", **seconds):
    s = dict.fromkeys(STATES, 0.0)
    s.update(seconds)
    return {"kind": kind, "step": step, "t0": t0, "s": s, "time": t0 + sum(s.values()), "job_id": job,
            "world_size": 2}


def test_account_of_two_restarts_and_a_second_job():
    records = [
        # start A: a new run; killed after step 20; the snapshot of step 10 is resumed
        ledger(1000, 0, "start", launch=2, model=1),
        ledger(1000, 10, launch=2, model=1, first_step=1, step_compute=8, step_data=1, snapshot=0.5, log=0.5),
        {"kind": "train", "step": 20, "loss": 1.0},
        ledger(1000, 20, launch=2, model=1, first_step=1, step_compute=16, step_data=2, snapshot=1, log=1),
        # start B, 2 s after A's last record: a warm restart from step 10, to the end (step 30)
        ledger(1026, 10, "start", launch=0.1, config=0.2, process_group=0.2, restore=0.5),
        ledger(1026, 30, launch=0.1, config=0.2, process_group=0.2, restore=0.5, first_step=0.5, step_compute=15,
               step_data=1, log=0.5),
        # start C: the same command run again much later (another job): nothing left to train
        ledger(5000, 30, "start", job="j2", launch=1, config=1),
    ]
    acc = account(records)
    assert [a.first_step for a in acc.attempts] == [0, 10, 30]
    assert acc.gaps == [0.0, pytest.approx(2.0), 0.0]  # the hours between the two jobs are not the job's
    expected = {"training": 8 + 15, "data_wait": 1 + 1, "lost": 18 - 9, "down": 2, "startup": 4 + 1.5 + 2,
                "snapshot": 1, "eval": 0, "log": 1.5}
    assert {c: pytest.approx(v) for c, v in expected.items()} == acc.seconds
    assert acc.wall == pytest.approx(24 + 2 + 18 + 2)
    assert sum(acc.seconds[c] for c in CATEGORIES) == pytest.approx(acc.wall)
    assert acc.goodput == pytest.approx(23 / 46)
    assert acc.lost_steps == [10, 0, 0]


def test_a_snapshot_older_than_the_previous_start_loses_the_steps_of_both_starts():
    records = [
        ledger(0, 0, "start"),
        ledger(0, 20, step_compute=20),  # A: steps 1-20, snapshots at 10 and 20
        ledger(30, 20, "start"),
        ledger(30, 25, step_compute=5),  # B: resumed at 20, killed at 25
        ledger(40, 10, "start"),  # C: the snapshot of step 20 was damaged: back to 10
        ledger(40, 30, step_compute=20),
    ]
    acc = account(records)
    # A keeps steps 1-10 (interpolated: 10 s), B keeps nothing, C keeps 11-30
    assert acc.seconds["training"] == pytest.approx(10 + 0 + 20)
    assert acc.seconds["lost"] == pytest.approx(10 + 5)
    assert acc.lost_steps == [10, 5, 0]


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory):
    """A 2-process torchrun job, one worker SIGKILLed at step 25 and restarted by torchrun."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir = tmp / "run"
    cfg = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.block_size=64",
           "trainer.batch_size=16", "trainer.micro_batch_size=4", "trainer.log_every=5", "trainer.eval_every=20",
           "trainer.progress=false", "trainer.max_steps=60", "snapshot.every_steps=10",
           f"data.path={make_corpus(tmp)}", f"data.cache_dir={tmp / 'cache'}", f"trainer.run_dir={run_dir}"]
    t0 = time.time()
    agent = subprocess.Popen(torchrun_cmd(2, "mingpt/main.py", *cfg, max_restarts=2), cwd=REPO, env=torchrun_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 25 for r in records(metrics)):
        assert agent.poll() is None and time.time() < deadline, "step 25 not reached"
        time.sleep(0.01)
    workers = [int(p) for p in open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()]
    os.kill(workers[-1], signal.SIGKILL)
    out, _ = agent.communicate(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    return run_dir, time.time() - t0


def records_of(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_sigkilled_job_is_accounted_from_its_metrics_alone(faulted_run):
    run_dir, wall_outside = faulted_run
    records = records_of(run_dir)
    acc = account(records)
    starts = [r for r in records if r["kind"] == "start"]
    assert len(acc.attempts) == 2 and len(starts) == 2
    assert acc.gaps[0] == 0 and acc.gaps[1] > 0
    # resumed from the snapshot of step 20 or 10; the steps trained after it were lost
    resumed = acc.attempts[1].first_step
    assert resumed in (10, 20) and acc.lost_steps[0] == acc.attempts[0].last_step - resumed >= 25 - resumed
    assert acc.seconds["lost"] > 0 and acc.seconds["down"] > 0 and acc.seconds["training"] > 0
    assert sum(acc.seconds[c] for c in CATEGORIES) == pytest.approx(acc.wall)
    # the job's wall time from its records: from the first process start to the last record
    assert 0.5 * wall_outside < acc.wall < wall_outside
    committed = [r for r in records if r["kind"] == "snapshot" and r["status"] == "committed"]
    assert {r["step"] for r in committed} >= {10, 20, 60}
    assert all(r["bytes"] > 0 and r["total_s"] >= r["blocking_s"] >= 0 for r in committed)


def test_report_summary_and_self_contained_html(faulted_run, tmp_path):
    run_dir, _ = faulted_run
    html_path = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "mingpt.report", str(run_dir), "--html", str(html_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "steps 60" in out and "1 restart, 1 job" in out and "world size 2" in out
    assert re.search(r"goodput \d+\.\d% of", out)
    assert "best val loss" in out and "slowest ranks" in out and "snapshots: " in out
    assert re.search(r"at step \d+ \(world 2 -> 2\): down \d+\.\d s", out)
    page = html_path.read_text()
    ids = re.findall(r'<figure id="(\w+)"><img alt="[^"]*" data-points="(\d+)"', page)
    assert [i for i, _ in ids] == ["loss", "throughput", "ranks", "snapshots", "goodput"]
    assert all(int(n) > 0 for _, n in ids)
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere


def test_report_of_a_directory_without_metrics_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mingpt.report", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "no metrics at" in proc.stderr and "Traceback" not in proc.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium): the page is not rendered")
def test_the_report_renders_in_a_real_browser(faulted_run, tmp_path):
    run_dir, _ = faulted_run
    page = tmp_path / "report.html"
    subprocess.run([sys.executable, "-m", "mingpt.report", str(run_dir), "--html", str(page)], check=True,
                   capture_output=True, cwd=REPO, timeout=120)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-plots="5/5"' in body and "data-errors" not in body, body
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] == 2400 and pixels.std() > 0.05  # drawn, not a blank page


def test_the_summary_counts_steps_past_the_last_logged_one_and_every_save_is_a_visible_bar(monkeypatch):
    """A run stopped (or saved) after its last logged step reports that step; a save of a fraction of a
    second is a bar a few points wide at its commit, on an axis of minutes."""
    from matplotlib.collections import LineCollection

    from mingpt.report import html
    from mingpt.report.summary import Run, summary

    saves = [{"kind": "snapshot", "step": s, "status": "committed", "total_s": 0.2, "blocking_s": 0.01,
              "time": 1000 + 6 * s} for s in (10, 20, 47)]
    run = Run.of([ledger(1000, 0, "start"), {"kind": "train", "step": 40, "loss": 2.0, "tokens_seen": 400},
                  ledger(1000, 47, step_compute=280), *saves])
    assert "  steps 47   last logged step 40: tokens 400   last train loss 2.0000" in summary(run, "r")
    monkeypatch.setattr(html, "_figure", lambda fig, *args: fig)
    ax = html.snapshot_figure(run).axes[0]
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(bars) == 1 and min(bars[0].get_linewidths()) >= 3  # points: visible on any axis
    assert [(a[0], b[0], b[1]) for a, b in bars[0].get_segments()] == [(s["step"] / 10, s["step"] / 10, 0.2)
                                                                      for s in saves]
