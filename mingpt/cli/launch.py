"""torchrun, with the failures of its own rendezvous said in one line: `mingpt-torchrun` takes exactly
torchrun's arguments.

    mingpt-torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST1:29500 \\
        --rdzv_conf=read_timeout=10,join_timeout=300 ... mingpt/main.py ...

An endpoint nobody listens on, a blocked port or a name that does not resolve fails after
`read_timeout` seconds (torchrun's default: 60); nodes that never all arrive fail after
`join_timeout` (default: 600). torchrun reports these with a stack trace; this reports what to check.
"""

from __future__ import annotations

import sys


def _option(argv: list[str], name: str, default: str) -> str:
    """The value of a torchrun option, written --rdzv_x=V, --rdzv-x=V or --rdzv_x V."""
    names = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in names:
            return value or (argv[i + 1] if i + 1 < len(argv) else default)
    return default


def _conf(argv: list[str], key: str, default: str) -> str:
    for item in _option(argv, "rdzv_conf", "").split(","):
        k, _, v = item.partition("=")
        if k.strip() == key:
            return v.strip()
    return default


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun

    argv = sys.argv[1:] if argv is None else argv
    endpoint = _option(argv, "rdzv_endpoint", "localhost:29400")
    try:
        torchrun(argv)
    except RendezvousConnectionError as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        sys.exit(f"mingpt-torchrun: cannot reach the rendezvous store at {endpoint} within read_timeout="
                 f"{_conf(argv, 'read_timeout', '60')} s ({cause}). Check that the node it runs on is up and started "
                 "first (or mingpt-rendezvous runs there), that its name resolves from this node, and that the port "
                 "is open in the firewalls between them")
    except RendezvousTimeoutError:
        sys.exit(f"mingpt-torchrun: the nodes did not all join the rendezvous at {endpoint} within join_timeout="
                 f"{_conf(argv, 'join_timeout', '600')} s (--nnodes={_option(argv, 'nnodes', '?')}). Check that "
                 "every node was started with the same --rdzv_endpoint and --rdzv_id")


if __name__ == "__main__":
    main()
