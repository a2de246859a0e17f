"""A torchrun worker dies with its agent, whoever adopts it (mingpt/orphan.py)."""

import contextlib
import os
import signal
import subprocess
import sys

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
from mingpt import orphan
print("worker", os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("parent", os.getppid(), flush=True)
orphan.die_with_agent()
print("survived", flush=True)
"""


def test_a_worker_adopted_by_a_subreaper_after_its_agent_died_exits(tmp_path):
    """Issue 33: the kernel gives the orphan to the nearest child subreaper, not PID 1, and the worker
    kept running beside the job's next attempt."""
    go = tmp_path / "go"
    reaper = subprocess.Popen([sys.executable, "-c", SUBREAPER, AGENT, WORKER.replace("sys.argv[1]", repr(str(go)))],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
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
