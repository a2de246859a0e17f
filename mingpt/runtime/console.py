"""What every command-line tool does alike at the terminal (standard library only)."""

from __future__ import annotations

import functools
import logging
import os
import sys

from mingpt.runtime.exits import CLOSED_PIPE


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
            return CLOSED_PIPE

    return wrapper


def setup_logging(info) -> None:
    """A training process's log (`info`: its DistInfo): one format naming host, local rank and
    current rank; INFO from rank 0 only, plus one line from the first process of every other node."""
    fmt = (f"%(asctime)s {info.hostname}:{info.local_rank} [rank {info.rank}/{info.world_size}] "
           "%(levelname)s %(name)s: %(message)s")
    logging.basicConfig(level=logging.INFO if info.is_rank0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    if info.local_rank == 0:
        logging.getLogger("mingpt.node").setLevel(logging.INFO)
    for chatty in ("aiobotocore", "botocore", "s3fs"):  # their INFO lines ("Found credentials ...") are not ours
        logging.getLogger(chatty).setLevel(logging.WARNING)
