"""A torchrun worker dies with its agent, and a Ctrl-C while it starts ends it quietly. Standard
library only: main.py calls these before the imports that take seconds, so the window in which a
dying agent leaves an orphan, or a Ctrl-C a traceback, is the interpreter's start.

torchrun starts each worker in its own session, so a SIGKILLed agent (a node's job killed by a
scheduler, an OOM killer) would leave workers that keep training, and writing snapshots, beside the
job's next attempt, holding the GPUs.
"""

from __future__ import annotations

import os
import signal
import sys

from mingpt.runtime.exits import Exit

_PARENT = os.getppid()  # the agent, recorded at main.py's first import (unless it died already)
AGENT_ENV = "MINGPT_AGENT_PID"  # "PID:RUN_ID", the agent's pid, known before the worker starts: set by mingpt-torchrun
# and by the mingpt rendezvous (--rdzv_backend=mingpt, under plain torchrun too)


def die_with_agent() -> None:
    """Under torchrun, make the kernel SIGKILL this worker when its agent dies (Linux; a no-op
    elsewhere). A worker whose agent died before this ran is an orphan already: it exits at once.
    The kernel gave it to PID 1 or to the nearest child subreaper (some init systems and container
    runtimes), so its parent is no longer the one recorded at the start; a parent of PID 1 from
    the start means the same, unless PID 1 is the launcher itself (torchrun as a container's entry
    point). Under mingpt-torchrun or the mingpt rendezvous the parent is compared with the agent's pid
    they exported (MINGPT_AGENT_PID): a worker whose agent died while its interpreter started is caught too."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.getppid()  # read after arming: a death from now on is the signal's
    agent = _agent()
    if agent is not None:  # mingpt-torchrun said who the agent is: a death before _PARENT was read shows too
        if parent != agent:
            os._exit(Exit.FAILED)
        # this process's own children (a spawned pool re-runs main.py) have it as their parent
        os.environ[AGENT_ENV] = f"{os.getpid()}:{os.environ['TORCHELASTIC_RUN_ID']}"
    elif parent != _PARENT or (parent == 1 and not _is_launcher(1)):
        os._exit(Exit.FAILED)


def quiet_ctrl_c_while_starting() -> None:
    """Until the run installs its own handler (PreemptionFlag: save at the end of a step, then stop), a
    Ctrl-C ends this process at once with one line and 130: nothing has trained, so nothing is lost.
    Before, the imports it interrupted printed a KeyboardInterrupt traceback per worker (about 55 lines
    each), or threw it through torch's C++ (std::terminate)."""
    signal.signal(signal.SIGINT, _stop_while_starting)


def _stop_while_starting(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    if "__mp_main__" in sys.modules:  # a pool's process (spawn re-imports main.py): its parent decides
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one line a node (os.write: safe in a signal handler)
        os.write(2, b"Ctrl-C while starting: stopped before training, nothing to save\n")
    os._exit(Exit.INTERRUPTED)


def _agent() -> int | None:
    """The agent's pid that mingpt-torchrun or the mingpt rendezvous exported, if it is for this run (not
    inherited from another)."""
    pid, _, run_id = os.environ.get(AGENT_ENV, "").partition(":")
    return int(pid) if pid.isdigit() and run_id == os.environ.get("TORCHELASTIC_RUN_ID") else None


def _is_launcher(pid: int) -> bool:
    """Whether process `pid` is a torchrun agent: a program whose name ends in torchrun, or
    python -m torch.distributed.run (or .launch)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = fh.read().split(b"\0")
    except OSError:
        return True  # cannot tell: never kill a worker on a guess
    return any(w.endswith((b"torchrun", b"torch.distributed.run", b"torch.distributed.launch")) for w in words)
