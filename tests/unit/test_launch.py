"""mingpt-torchrun (mingpt/cli/launch.py)."""

import secrets
import stat
import subprocess
import sys

import pytest
from conftest import REPO
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mingpt.cli.launch import exit_code_of_failures, exit_code_of_signal, restart_reason
from mingpt.runtime.trust import job_secret, new_secret


def test_the_launchers_exit_code_after_a_signal_is_the_workers():
    assert exit_code_of_signal(2, [75, 75]) == 75  # Ctrl-C, and every worker saved
    assert exit_code_of_signal(15, [75, 75]) == 75
    assert exit_code_of_signal(2, [75, 74]) == 74  # one rank's save failed: the snapshot is not there
    assert exit_code_of_signal(2, [-9, -9]) == 130  # the workers said nothing: the shell's 128 + signal


def test_the_launchers_exit_code_is_the_worker_that_said_why_not_one_the_agent_stopped(tmp_path, capsys):
    def failure(rank: int, code: int, timestamp: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(tmp_path / "none.json"))
        f.timestamp = timestamp
        return f

    # rank 0 refused a bad setting (2); the agent then SIGTERMed rank 1, whose record can carry an
    # earlier second: torchrun's "first failure" was rank 1, and the launcher exited 1, not 2
    assert exit_code_of_failures([failure(0, 2, 1001), failure(1, -15, 1000)]) == 2
    assert capsys.readouterr().err == ""
    # only signals: the first, said in one line, with the shell's code
    assert exit_code_of_failures([failure(0, -9, 1000), failure(1, -15, 1001)]) == 137
    assert "worker 0 on" in capsys.readouterr().err


def test_the_restart_line_names_the_killed_worker_not_the_peer_that_lost_it(tmp_path):
    from types import SimpleNamespace

    def failure(rank: int, code: int, timestamp: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(tmp_path / "none.json"))
        f.timestamp = timestamp
        return f

    # worker 1 was SIGKILLed; worker 0 lost it and exited 1 within the same second, and comes first:
    # the line blamed worker 0 ("exited with code 1") about one run in three
    both = SimpleNamespace(failures={0: failure(0, 1, 1000), 1: failure(1, -9, 1000)})
    assert restart_reason(both) == "worker 1 was killed by SIGKILL"
    assert restart_reason(SimpleNamespace(failures={1: failure(1, 3, 1000)})) == "worker 1 exited with code 3"
    assert restart_reason(SimpleNamespace(failures={})) == ("a node asked for a new rendezvous round (one joined, "
                                                            "or a node's workers restarted)")


def test_a_new_rendezvous_round_says_whether_a_node_joined_or_a_peers_workers_restarted():
    """Before: a peer whose worker was SIGKILLed was announced on the other node as "a node joined the
    job". The rendezvous's own state tells them apart: an agent of this round waits again (its workers
    restarted), or one that is not waits (a node joined)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    here, peer, new = _NodeDesc("node1", 100, 0), _NodeDesc("node2", 200, 0), _NodeDesc("node3", 300, 0)
    state = _RendezvousState()
    state.participants = {here: 0, peer: 1}
    healthy = SimpleNamespace(failures={})
    state.wait_list = {peer}
    assert restart_reason(healthy, state) == "the workers on node2 (agent pid 200) restarted"
    state.wait_list = {new}
    assert restart_reason(healthy, state) == "a node joined the job (node3, agent pid 300)"
    state.wait_list = {new, peer}
    assert restart_reason(healthy, state) == ("the workers on node2 (agent pid 200) restarted; a node joined the job "
                                              "(node3, agent pid 300)")


def test_a_lost_lease_is_the_jobs_exit_code_and_never_retried(tmp_path):
    from mingpt.cli.launch import PERMANENT
    from mingpt.runtime.exits import Exit

    def failure(rank: int, code: int, timestamp: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(tmp_path / "none.json"))
        f.timestamp = timestamp
        return f

    assert Exit.LEASE_LOST in PERMANENT
    # rank 0 lost the store's lease and stopped; rank 1 then lost contact with it (exit 1) within the same second
    assert exit_code_of_failures([failure(1, 1, 1000), failure(0, Exit.LEASE_LOST, 1000)]) == Exit.LEASE_LOST


@pytest.mark.parametrize("error", ["forged state", "store gone"])
def test_a_forged_rendezvous_state_or_a_lost_store_is_one_line_not_a_traceback(monkeypatch, capsys, error):
    """Another user can name the signed state's key (list_keys) and overwrite it: the agents then refuse
    the state, and the launcher says so in one line instead of torch's traceback."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from mingpt.cli.launch import main

    def forged(args):
        if error == "store gone":  # the host of the store stopped while this agent waited on a value
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        raise RendezvousStateError("the rendezvous state in the store is not signed with this job's secret: a "
                                   "process outside the job wrote it, or the nodes were given different secrets")

    monkeypatch.setattr(torchrun, "run", forged)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secrets.token_hex(32))
    for name in ("MINGPT_AGENT_PID", "OMP_NUM_THREADS"):  # what main sets for its workers: undone after the test
        monkeypatch.setenv(name, "")
    with pytest.raises(SystemExit) as e:
        main(["--standalone", "--nproc_per_node=1", "mingpt/main.py"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("mingpt-torchrun: lost the rendezvous store at" if error == "store gone" else
                          "mingpt-torchrun: the rendezvous state in the store is not signed with this job's secret")


@pytest.mark.parametrize("script, overrides, message", [
    (["mingpt/main.py"], ["trainer.max_stepz=4"], "unknown config key trainer.max_stepz (did you mean trainer.max_steps?)"),
    (["-m", "mingpt.main"], ["--max_steps=4"], "--max_steps=4: settings are written without dashes, key=value"),
    (["mingpt/main.py"], ["model.n_head=5"], "is not divisible by model.n_head=5"),
])
def test_a_bad_setting_is_refused_by_the_launcher_before_any_worker_starts(monkeypatch, capsys, script, overrides,
                                                                           message):
    """Before: each worker imported torch (23 s on a 2-core machine) to say it."""
    from torch.distributed import run as torchrun

    from mingpt.cli.launch import main

    monkeypatch.setattr(torchrun, "run", lambda args: pytest.fail("the workers were started"))
    for name in ("MINGPT_AGENT_PID", "OMP_NUM_THREADS", "MINGPT_JOB_SECRET"):  # what main sets: undone after the test
        monkeypatch.setenv(name, "")
    with pytest.raises(SystemExit) as e:
        main(["--standalone", "--nproc_per_node=2", *script, *overrides])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("mingpt-torchrun: ") and message in err, err


def test_the_launcher_leaves_good_settings_hydras_flags_and_other_scripts_to_the_workers(monkeypatch):
    from torch.distributed import run as torchrun

    from mingpt.cli.launch import main

    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args.training_script_args))
    for name in ("MINGPT_AGENT_PID", "OMP_NUM_THREADS", "MINGPT_JOB_SECRET"):
        monkeypatch.setenv(name, "")
    for cmd in (["mingpt/main.py", "model=gpt-nano"], ["mingpt/main.py", "--cfg", "job"], ["other.py", "--max_stepz=1"]):
        main(["--standalone", "--nproc_per_node=2", *cmd])
    assert started == [["model=gpt-nano"], ["--cfg", "job"], ["--max_stepz=1"]]


C10D_CLIENT = """
import socket, sys, threading
from datetime import timedelta
if sys.argv[1] == "agent":
    import mingpt.cli.launch  # what mingpt-torchrun loads first
from torch.distributed import TCPStore
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
def hang_up():  # a store that goes away: c10d's client logs it from C++, with its stack frames
    while True:
        peer, _ = server.accept()
        peer.recv(64)
        peer.close()
threading.Thread(target=hang_up, daemon=True).start()
try:
    TCPStore("127.0.0.1", server.getsockname()[1], is_master=False, timeout=timedelta(seconds=2))
except Exception as e:
    print(type(e).__name__)
"""


def test_the_agent_prints_no_cpp_stack_frames_of_a_lost_store_and_its_workers_keep_them():
    """Before: a node whose rendezvous host died printed three c10d warnings of about 30 `frame #N` lines
    each before the launcher's one line. The C++ log level is the agent's alone: not in its environment."""
    import os
    import subprocess
    import sys

    def run(who: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
        return subprocess.run([sys.executable, "-c", C10D_CLIENT, who], capture_output=True, text=True, timeout=120,
                              env=env)

    plain, agent = run("plain"), run("agent")
    assert plain.stdout.strip() == agent.stdout.strip() == "DistNetworkError"  # the Python error is ours to say
    assert "frame #" in plain.stderr  # a process other than the agent (a worker) still has them
    assert "frame #" not in agent.stderr and "[c10d]" not in agent.stderr, agent.stderr
    assert "TORCH_CPP_LOG_LEVEL" not in subprocess.run(
        [sys.executable, "-c", "import os, mingpt.cli.launch; print(sorted(os.environ))"], capture_output=True,
        text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}).stdout


def test_new_secret_writes_a_random_secret_only_its_user_reads_and_never_overwrites_a_file(tmp_path):
    """The README's way to make a job's secret: `mingpt-torchrun --new-secret FILE`, then MINGPT_JOB_SECRET_FILE."""
    path = tmp_path / "job.secret"
    cmd = [sys.executable, "-m", "mingpt.cli.launch", "--new-secret"]
    made = subprocess.run([*cmd, str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "MINGPT_JOB_SECRET_FILE=" in made.stderr
    first = path.read_text()
    assert job_secret({"MINGPT_JOB_SECRET_FILE": str(path)}) == first.strip().encode() and len(first.strip()) == 64
    again = subprocess.run([*cmd, str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "is never overwritten" in again.stderr
    assert path.read_text() == first and sorted(p.name for p in tmp_path.iterdir()) == ["job.secret"]
    other = subprocess.run([*cmd, f"--new-secret={tmp_path / 'other.secret'}"], capture_output=True, cwd=REPO,
                           timeout=120)
    assert other.returncode == 2  # one file, and nothing else
    assert new_secret() != new_secret()
