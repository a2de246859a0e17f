"""The report of a real 2-process torchrun job, one worker SIGKILLed and restarted by torchrun:
goodput from its metrics alone, the summary and the self-contained page, rendered in a browser where
there is one."""

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
from mingpt.training.metrics import read_records


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


def test_a_sigkilled_job_is_accounted_from_its_metrics_alone(faulted_run):
    run_dir, wall_outside = faulted_run
    records = read_records(run_dir / "metrics.jsonl")
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
