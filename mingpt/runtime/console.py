"""What every command-line tool does alike at the terminal (standard library only)."""

from __future__ import annotations

import functools
import os
import sys

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away


def quiet_on_closed_pipe(main):
    """Wrap a tool's main(): when its reader stops early (`mingpt-snapshot show | head`), it ends
    quietly, as Unix tools do, instead of printing a BrokenPipeError traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()  # inside the try: the interpreter's own flush at exit would raise again
            return code
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that nothing writes to it again
            return EXIT_CLOSED_PIPE

    return wrapper
