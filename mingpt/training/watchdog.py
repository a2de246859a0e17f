"""A hung-step watchdog: a rank that makes no progress for too long says so and exits.

A network partition or a dead peer can leave a collective blocked until the process-group
timeout, or forever in code outside one. The watchdog thread notices that no step finished for
`timeout_s`, logs which rank on which host is stuck at which step, and ends the process with a
non-zero code so that torchrun restarts the workers from the latest snapshot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from mingpt.runtime.exits import Exit

log = logging.getLogger(__name__)


def _exit_hung(message: str) -> None:
    log.error("%s; exiting so that torchrun restarts the workers", message)
    logging.shutdown()
    os._exit(Exit.HUNG)  # the main thread is stuck: a normal exit would wait for it


class Watchdog:
    def __init__(self, timeout_s: float, where: str, on_hang: Callable[[str], None] = _exit_hung,
                 poll_s: float | None = None):
        self.timeout_s, self.where, self.on_hang = timeout_s, where, on_hang
        self.poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
        self._last = time.monotonic()
        self._step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """Record progress (call after each step, and around long pauses such as evaluation)."""
        self._last, self._step = time.monotonic(), step

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self.on_hang(f"{self.where} made no progress for {idle:.0f} s after step {self._step} "
                             f"(watchdog timeout {self.timeout_s:.0f} s): a peer is dead, stuck or partitioned")
                return
