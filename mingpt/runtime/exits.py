"""How a process of the job ends: its exit codes, the signals that ask it to stop, its one report of an
error and its exit. Standard library only: orphan.py and console.py, which run before anything heavy,
name the same codes."""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import sys
import time
from typing import NoReturn

log = logging.getLogger(__name__)


class Exit(enum.IntEnum):
    """The job's exit codes, each with its meaning: the README's "Exit codes" table (tests/test_readme.py
    holds the two together). sysexits.h's code where one fits. A run that stopped on request is not 0,
    so that schedulers count the attempt as unfinished; a second Ctrl-C is the shell's 128 + SIGINT, so
    that a stop without a save never reads like one with it."""

    meaning: str

    def __new__(cls, code: int, meaning: str) -> Exit:
        member = int.__new__(cls, code)
        member._value_, member.meaning = code, meaning
        return member

    DONE = 0, "finished (trainer.max_steps reached) and the final snapshot committed"
    FAILED = 1, "anything else, with its traceback (a lost peer: one line, then torchrun restarts the workers)"
    BAD_INPUT = 2, "a bad setting or input (config, data, snapshot, a store it cannot write to): one line"
    HUNG = 70, "EX_SOFTWARE: a rank made no progress for trainer.watchdog_s; torchrun restarts the workers"
    SAVE_FAILED = 74, "EX_IOERR: the snapshot it stopped with could not be saved after its retries"
    PREEMPTED = 75, "EX_TEMPFAIL: stopped on request (SIGTERM, SIGUSR1, Ctrl-C) and saved; the same command resumes"
    LEASE_LOST = 77, "EX_NOPERM: another launch took the snapshot store's lease over; stopped without committing"
    INTERRUPTED = 130, "stopped at once on a second Ctrl-C (or one while starting), nothing saved"


# The command-line tools' one code of their own (not a job's): a shell's 128 + SIGPIPE for a Unix tool
# whose reader went away.
CLOSED_PIPE = 141

# An error every rank meets (a bad setting, a missing file) is printed by rank 0; the other ranks
# wait this long before exiting, since torchrun stops the rest of the job at the first exit it sees.
LET_RANK0_REPORT_S = 2.0


def report_error(info, message: str, code: int, detail: str | None = None,
                 each_node: bool = False, level: int = logging.ERROR, let_rank0_report: bool = False) -> int:
    """Report a failure once and hand it to torchrun; returns the exit code (`info`: the process's
    DistInfo).

    The message goes to torchrun's error file (TORCHELASTIC_ERROR_FILE, the one `@record` writes),
    so the summary torchrun prints names it as the root cause instead of "error_file: <N/A>".
    It is logged by the first rank only (every rank usually meets the same error), or with
    `each_node` also by the first process of every node (a lost peer: rank 0 may be the one gone).
    `detail` (a traceback) goes to the error file and the log in place of the message. With
    `let_rank0_report`, other ranks wait a moment first, so that rank 0 prints it before torchrun
    stops the job.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        record = {"message": {"message": message, "extraInfo": {"py_callstack": detail or message,
                                                                "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as fh:
                json.dump(record, fh)
        except OSError as e:
            log.warning("cannot write torchrun's error file %s: %s", path, e)
    if info.is_rank0 or (each_node and info.local_rank == 0):
        logging.getLogger("mingpt").log(level, "%s", detail.rstrip() if detail else message)
    elif let_rank0_report and info.distributed:
        time.sleep(LET_RANK0_REPORT_S)
    return code


def exit_process(code: int, had_process_group: bool) -> NoReturn:
    """End the process with `code`, everything of ours already closed and the group destroyed.

    A process that used a process group ends without the interpreter's shutdown. PyTorch stashes a
    Python object in thread-local state at every backward (a contextvars context), and every
    collective queued afterwards carries a copy of that state. gloo's worker threads drop finished
    work after the caller has its result; one that does so while the interpreter shuts down cannot
    take the GIL and aborts the process: "terminate called without an active exception", SIGABRT.
    (Freeing the process group ourselves first would join those threads while holding the GIL.)
    """
    if not had_process_group:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What mingpt-torchrun's agent sends its workers when it restarts them (a worker failed, a node joined):
# they save and stop as on SIGTERM, and say that torchrun restarts them, not that anyone must act.
RESTART_SIGNAL = signal.SIGUSR2


class PreemptionFlag:
    """A request to stop cleanly: SIGTERM (torchrun forwards it on shutdown; SLURM sends it before a
    kill), SIGUSR1 (`sbatch --signal`) or SIGINT (Ctrl-C; torchrun forwards it to the workers).

    The handler only records the request: the ranks agree on it at the next step boundary, save
    once and exit (Exit.PREEMPTED), so no rank hangs waiting for one that was not signalled. A second
    Ctrl-C means "now": the process exits at once, without saving (Exit.INTERRUPTED; the previous
    snapshot stays).
    """

    def __init__(self, announce: bool = True):
        self.signum: int | None = None
        self.announce = announce  # say so on the terminal (the first rank only, not once per rank)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def restarting(self) -> bool:
        """The request came from mingpt-torchrun's agent restarting the workers (nobody need act)."""
        return self.signum == RESTART_SIGNAL

    def describe(self) -> str:
        if self.restarting:
            return "torchrun restarts the workers"
        if self.signum is None:
            return "stopping (signalled on another rank)"
        return f"stopping on {signal.Signals(self.signum).name}"

    def install(self, signums=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, RESTART_SIGNAL)) -> PreemptionFlag:
        for s in signums:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        # A second Ctrl-C means "now". Under torchrun it reaches the agent, which then sends the
        # workers SIGTERM: so any signal during a Ctrl-C stop, or a Ctrl-C during any stop, is one.
        if self.signum is not None and signal.SIGINT in (signum, self.signum):
            if self.announce:
                os.write(2, b"\nsecond Ctrl-C: stopping now, without a snapshot\n")
            os._exit(Exit.INTERRUPTED)
        if signum == signal.SIGINT and self.announce:
            os.write(2, b"\nCtrl-C: saving a snapshot at the end of this step, then stopping "
                        b"(Ctrl-C again to stop now)\n")
        self.signum = signum
