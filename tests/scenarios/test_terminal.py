"""What a person at a terminal sees: a run in a pseudo-terminal, its progress bar and log lines,
and Ctrl-C (SIGINT) once and twice."""

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import REPO, torchrun_cmd, torchrun_env

from mingpt.snapshot import SnapshotStore

pytestmark = pytest.mark.slow

TINY = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.block_size=32",
        "trainer.batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0", "optim.warmup_steps=2"]
# Steps of about a third of a second on two cores: a signal always lands inside a step.
SLOW = ["model=gpt-mini", "data.block_size=128", "trainer.batch_size=32", "trainer.micro_batch_size=32",
        "trainer.eval_every=0", "trainer.log_every=1"]
TIMESTAMP = re.compile(r"^\d\d:\d\d:\d\d ")


class Terminal:
    """A child process whose stdout and stderr are a pseudo-terminal, as in an interactive shell."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.master, self.screen = master, b""

    def read(self, timeout: float) -> None:
        if select.select([self.master], [], [], timeout)[0]:
            try:
                self.screen += os.read(self.master, 65536)
            except OSError:  # EIO: the child closed the terminal
                pass

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while text.encode() not in self.screen:
            assert time.time() < deadline and self.proc.poll() is None, self.text[-3000:]
            self.read(0.05)

    def finish(self, timeout: float = 120) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.read(0.05)
        self.read(0.2)
        os.close(self.master)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("still running:\n" + self.text[-3000:])
        return self.proc.returncode

    @property
    def text(self) -> str:
        return self.screen.decode(errors="replace")


def common(corpus, tmp_path, run_dir):
    return [f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}"]


def committed_steps(run_dir: Path) -> list[int]:
    return [s.step for s in SnapshotStore(str(run_dir / "snapshots")).list() if s.committed]


def test_log_lines_never_land_inside_the_progress_bar(corpus_file, tmp_path):
    term = Terminal([sys.executable, "-m", "mingpt.main", *TINY, *common(corpus_file, tmp_path, tmp_path / "run"),
                     "trainer.max_steps=60", "trainer.log_every=3"])
    assert term.finish() == 0, term.text[-3000:]
    assert "step/s]" in term.text  # the bar was shown
    logged = 0
    for line in term.text.replace("\r\n", "\n").split("\n"):
        shown = line.split("\r")[-1]  # what stays on screen after carriage returns
        if " INFO " in line:
            assert TIMESTAMP.match(shown), f"a log line shares its line with the bar: {line!r}"
            logged += 1
    assert logged >= 20


def test_ctrl_c_saves_the_current_step_and_stops_with_a_short_message(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mingpt.main", *SLOW, *common(corpus_file, tmp_path, run_dir),
           "trainer.max_steps=1000", "snapshot.every_steps=0"]
    term = Terminal(cmd)
    term.wait_for("step 3 |")
    os.kill(term.proc.pid, signal.SIGINT)
    assert term.finish() == 75  # stopped and saved (130 is kept for a second Ctrl-C: nothing saved)
    (step,) = committed_steps(run_dir)
    assert step >= 3
    assert term.text.count("Ctrl-C: saving a snapshot") == 1
    assert f"stopping on SIGINT: snapshot of step {step} saved" in term.text
    assert "Traceback" not in term.text and "KeyboardInterrupt" not in term.text
    # and the same command continues from there
    term = Terminal([*cmd[:-2], f"trainer.max_steps={step + 2}", "snapshot.every_steps=0"])
    assert term.finish() == 0
    assert f"resumed from snapshot step {step}" in term.text


def test_a_second_ctrl_c_stops_at_once_without_saving(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    term = Terminal([sys.executable, "-m", "mingpt.main", *SLOW, *common(corpus_file, tmp_path, run_dir),
                     "trainer.max_steps=1000", "snapshot.every_steps=0"])
    term.wait_for("step 2 |")
    os.kill(term.proc.pid, signal.SIGINT)
    time.sleep(0.02)  # well inside the same step
    t0 = time.time()
    os.kill(term.proc.pid, signal.SIGINT)
    assert term.finish(timeout=10) == 130
    assert time.time() - t0 < 2
    assert "second Ctrl-C: stopping now, without a snapshot" in term.text
    assert committed_steps(run_dir) == [] and "Traceback" not in term.text


@pytest.mark.long  # (CI: the same under the README's launcher, below)
def test_ctrl_c_under_torchrun_saves_once_and_no_worker_prints_a_traceback(corpus_file, tmp_path):
    """In a terminal Ctrl-C reaches torchrun's agent, which forwards SIGINT to its workers."""
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(2, "mingpt/main.py", *SLOW, *common(corpus_file, tmp_path, run_dir), "trainer.max_steps=1000",
                       "snapshot.every_steps=0")
    term = Terminal(cmd, env=torchrun_env())
    term.wait_for("step 2 |")
    os.kill(term.proc.pid, signal.SIGINT)
    assert term.finish() != 0  # plain torchrun: 1, and its agent's traceback (mingpt-torchrun: below)
    (step,) = committed_steps(run_dir)
    assert term.text.count("Ctrl-C: saving a snapshot") == 1  # the first rank says so, not every rank
    assert term.text.count(f"stopping on SIGINT: snapshot of step {step} saved") == 1
    assert "[rank0]: Traceback" not in term.text and "[rank1]: Traceback" not in term.text
    assert "KeyboardInterrupt" not in term.text


def test_ctrl_c_under_the_readmes_launcher_exits_75_with_our_lines_only(corpus_file, tmp_path):
    """The README's launch command: Ctrl-C saves, the job exits 75 (plain torchrun: 1, then a
    30-line agent traceback), and nothing of torchrun's own is printed."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--standalone", "--nproc_per_node=2", "mingpt/main.py", *SLOW,
           *common(corpus_file, tmp_path, run_dir), "trainer.max_steps=1000", "snapshot.every_steps=0"]
    term = Terminal(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    term.wait_for("step 2 |")
    os.kill(term.proc.pid, signal.SIGINT)
    assert term.finish() == 75, term.text[-3000:]
    (step,) = committed_steps(run_dir)
    assert term.text.count("Ctrl-C: saving a snapshot") == 1  # the first rank says so, not every rank
    assert term.text.count(f"stopping on SIGINT: snapshot of step {step} saved") == 1
    for torchruns in ("Traceback", "torch/distributed", "SignalException", "OMP_NUM_THREADS"):  # no worker's either
        assert torchruns not in term.text, term.text[-3000:]


def test_ctrl_c_while_the_workers_import_ends_the_job_at_once_in_one_line(corpus_file, tmp_path):
    """The README's launcher, Ctrl-C (SIGINT to the terminal's process group) while both workers still
    import torch: before, about 110 lines of KeyboardInterrupt tracebacks (or torch's C++ terminate),
    and once an agent that ran on until a SIGTERM. Now one line, and the job ends with 130."""
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--standalone", "--nproc_per_node=2", "mingpt/main.py",
           "model=gpt-nano", "data.block_size=32", *common(corpus_file, tmp_path, tmp_path / "run"), "trainer.max_steps=3"]
    term = Terminal(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    while True:  # both workers are in their imports once torch's library is loaded into them
        workers = Path(f"/proc/{term.proc.pid}/task/{term.proc.pid}/children").read_text().split()
        if len(workers) == 2 and all("libtorch_cpu" in Path(f"/proc/{w}/maps").read_text() for w in workers):
            break
        assert time.time() < deadline and term.proc.poll() is None, term.text[-3000:]
        term.read(0.01)
    os.killpg(term.proc.pid, signal.SIGINT)
    assert term.finish(timeout=30) == 130, term.text[-3000:]
    assert " joined: " not in term.text, term.text[-3000:]  # the workers were still starting
    assert "Traceback" not in term.text and "KeyboardInterrupt" not in term.text, term.text[-3000:]
    assert term.text.strip().splitlines() == ["Ctrl-C while starting: stopped before training, nothing to save"], term.text
