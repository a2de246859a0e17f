"""A torchrun worker dies with its agent, whoever adopts it (mingpt/runtime/orphan.py)."""

import contextlib
import os
import signal
import subprocess
import sys

from conftest import REPO

# A child subreaper (PR_SET_CHILD_SUBREAPER = 36), like systemd --user or a container's init: it
# adopts the orphans below it instead of PID 1, and says how each child it reaps ended.
SUBREAPER = """
import ctypes, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1)
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while True:
    try:
        pid, status = __import__("os").wait()
    except ChildProcessError:
        break
    print("ended", pid, __import__("os").waitstatus_to_exitcode(status), flush=True)
"""
AGENT = """
import os, subprocess, sys, time
print("agent", os.getpid(), flush=True)
subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "TORCHELASTIC_RUN_ID": "test"})
time.sleep(600)
"""
# main.py's order: import orphan (which records the parent), then die_with_agent(); the agent is
# killed in between, which the file `go` tells
WORKER = """
import os, sys, time
from mingpt.runtime import orphan
print("worker", os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("parent", os.getppid(), flush=True)
orphan.die_with_agent()
print("survived", flush=True)
"""


def orphaned(tmp_path, agent: str, worker: str, env: dict | None = None) -> None:
    """Under a child subreaper, `agent` starts `worker`; the agent is SIGKILLed, then the worker goes on
    (the file `go`): it must see the subreaper as its parent and exit 1 at once."""
    go = tmp_path / "go"
    reaper = subprocess.Popen([sys.executable, "-c", SUBREAPER, agent, worker.replace("sys.argv[1]", repr(str(go)))],
                              stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        seen = {}
        while not {"agent", "worker"} <= seen.keys():
            what, pid = reaper.stdout.readline().split()
            seen[what] = int(pid)
        os.kill(seen["agent"], signal.SIGKILL)
        assert reaper.stdout.readline().split() == ["ended", str(seen["agent"]), str(-signal.SIGKILL)]
        go.touch()  # the agent is dead and reaped: the worker is the subreaper's now
        out = reaper.communicate(timeout=60)[0].split("\n")
        assert out[0] == f"parent {reaper.pid}"  # adopted by the subreaper, not PID 1
        assert out[1:] == [f"ended {seen['worker']} 1", ""], "the orphan went on"
    finally:  # whatever failed, nothing started here keeps running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reaper.pid, signal.SIGKILL)
        reaper.wait()


def test_a_worker_adopted_by_a_subreaper_after_its_agent_died_exits(tmp_path):
    """Issue 33: the kernel gives the orphan to the nearest child subreaper, not PID 1, and the worker
    kept running beside the job's next attempt."""
    orphaned(tmp_path, AGENT, WORKER)


# mingpt-torchrun's agent: it says its pid in the workers' environment (MINGPT_AGENT_PID)
TOLD_AGENT = AGENT.replace('"TORCHELASTIC_RUN_ID": "test"',
                           '"TORCHELASTIC_RUN_ID": "test", "MINGPT_AGENT_PID": f"{os.getpid()}:test"')
# the agent is killed while the worker's interpreter starts: before it imports mingpt.runtime.orphan
EARLY_WORKER = """
import os, sys, time
print("worker", os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
from mingpt.runtime import orphan
print("parent", os.getppid(), flush=True)
orphan.die_with_agent()
print("survived", flush=True)
"""


def test_a_worker_whose_agent_died_while_it_started_exits_under_mingpt_torchrun(tmp_path):
    """The parent recorded at import is already the subreaper: only the agent's pid, told by
    mingpt-torchrun, shows that the worker is an orphan."""
    orphaned(tmp_path, TOLD_AGENT, EARLY_WORKER, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_mingpt_torchrun_tells_its_workers_its_pid_for_their_run_only(monkeypatch):
    from mingpt.runtime import orphan

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run1")
    monkeypatch.setenv("MINGPT_AGENT_PID", "4242:run1")
    assert orphan._agent() == 4242
    monkeypatch.setenv("MINGPT_AGENT_PID", "4242:another-run")  # inherited from an outer launch
    assert orphan._agent() is None


def test_a_workers_own_children_are_not_taken_for_orphans():
    """A spawned process pool re-runs main.py, die_with_agent included: its parent is the worker."""
    child = "from mingpt.runtime import orphan; orphan.die_with_agent(); print('child alive', flush=True)"
    worker = f"import subprocess, sys; from mingpt.runtime import orphan; orphan.die_with_agent(); " \
             f"subprocess.run([sys.executable, '-c', {child!r}])"
    agent = f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}], env={{**os.environ, " \
            "'TORCHELASTIC_RUN_ID': 'test', 'MINGPT_AGENT_PID': f'{os.getpid()}:test'})"
    out = subprocess.run([sys.executable, "-c", agent], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout == "child alive\n", out.stderr
