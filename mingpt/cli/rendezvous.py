"""A standalone rendezvous store, so that no training node is a single point of failure.

torchrun's c10d rendezvous keeps its store inside the agent on the --rdzv_endpoint host: if that
node dies, every other agent loses the rendezvous and the whole job ends. Run this on a small,
stable machine (a login or head node) instead, and give every agent `is_host=0`:

    mingpt-rendezvous --host 10.1.2.3 --port 29400        # the address the nodes reach it at
    torchrun --nnodes=1:4 --rdzv_backend=c10d --rdzv_endpoint=STORE_HOST:29400 \\
        --rdzv_conf=is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10 ...

It listens on that address only. Whoever reaches the port can run code on every agent (torchrun's
rendezvous unpickles what it reads from the store): choose an address on the cluster's private
network, never 0.0.0.0 on a machine with a public interface.

For a fully replicated store, use torchrun's etcd backend (`--rdzv_backend=etcd-v2`) with an etcd cluster.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from datetime import timedelta

from torch.distributed import TCPStore

log = logging.getLogger("mingpt.rendezvous")


def serve(host: str, port: int, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Host a TCPStore on host:port (that address only) until `stop` is set (or forever)."""
    # TCPStore listens on every interface whatever host it is given: bind the socket here and hand it over.
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(512)
    store = TCPStore(host, listener.getsockname()[1], is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60), master_listen_fd=listener.fileno(), use_libuv=True)
    log.info("rendezvous store listening on %s:%d", host, store.port)
    if ready is not None:
        ready.set()
    (stop or threading.Event()).wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mingpt-rendezvous", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True, help="the address to listen on: the one the nodes reach this machine "
                    "at (whoever reaches it can run code on every agent)")
    ap.add_argument("--port", type=int, default=29400)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    serve(args.host, args.port, stop=stop)


if __name__ == "__main__":
    main()
