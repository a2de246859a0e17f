"""torchrun's c10d rendezvous, made safe on machines shared with other users: `--rdzv_backend=mingpt`.

torchrun's own c10d rendezvous keeps its state in a TCPStore that listens on every interface, has
no authentication, and is unpickled by every agent on every keep-alive: whoever reaches the port
and knows the run id (it is on the agent's command line) can run code as the job's user. This
backend is the same rendezvous with these changes:

- its state is signed with the job's secret (HMAC-SHA256) and verified before it is unpickled;
- the values torch's agents take from the store (MASTER_ADDR, MASTER_PORT, the agents' ranks) are
  signed too (mingpt.runtime.trust.SignedStore): a forged one is ignored, or waited out and refused in one line;
- its keys live under a prefix derived from the secret, which keeps jobs apart, not hidden: a
  TCPStore lists its keys (`list_keys()`) to anyone who reaches the port;
- the agent that hosts the store listens on the --rdzv_endpoint address only.

So another user who reaches the port can list, overwrite and delete keys, and so make the job fail
or restart (gloo's addresses in the workers' store cannot be signed), but cannot make it run code
(nothing unsigned is unpickled) or feed it state (every value it reads is signed). Keep them out
with the network: one only the job's hosts reach, or a network namespace per job on shared nodes.

It also makes the workers host their own store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, bound and
prefixed the same way by mingpt.runtime.distributed) and gives them MINGPT_LAUNCH_ID, the same on every node
and every restart of one launch, and MINGPT_AGENT_PID (their agent: mingpt/runtime/orphan.py). The
secret comes from MINGPT_JOB_SECRET or MINGPT_JOB_SECRET_FILE (see README: two machines; `mingpt-torchrun
--new-secret FILE` makes one); `mingpt-torchrun --standalone` makes one for a one-machine job.

    torchrun --rdzv_backend=mingpt --rdzv_endpoint=HOST1:29500 --rdzv_id=run1 ...   # registered as a torchrun handler

`mingpt-rendezvous` hosts such a store on its own, so that no training node is a single point of
failure: run it on a machine of the job that outlives the training nodes (never a login node shared
with other users), and give every agent `--rdzv_conf=is_host=0`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, _RendezvousState, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mingpt.cli.launch_id import agreed_nonce, launch_id
from mingpt.runtime.orphan import AGENT_ENV
from mingpt.runtime.trust import SECRET_ENV, SECRET_FILE_ENV, SecretError, SignedStore, bound_store, derive, job_secret

log = logging.getLogger("mingpt.rendezvous")

TAG = hashlib.sha256().digest_size


# A state or launch nonce written longer ago than this (by its writer's clock) is a recording: every live
# agent rewrites the state at each keep-alive (5 s), and torch itself drops a node unheard for 15 s, so
# it already needs the nodes' clocks to agree to within a few seconds.
FRESH_S = 30.0
_SENTINEL = C10dRendezvousBackend._NULL_SENTINEL  # torch's "no state yet" value of the key


class SignedBackend(RendezvousBackend):
    """torch's c10d backend (its store key, its compare_set protocol) with every state signed on the
    way in and checked on the way out, so that the handler unpickles only what a member of this launch
    wrote lately. A state is signed (HMAC-SHA256) with its key, the launch's nonce, a write counter and
    the time it was written. A value that is not such a state (forged, another launch's, a recording
    older than FRESH_S, or older than one this agent has seen) is ignored: the agent goes on with the
    last good state it saw, and its next write (a keep-alive, at most 5 s later) replaces the value."""

    def __init__(self, store, run_id: str, key: bytes):
        self._store, self._name, self._key = store, "torch.rendezvous." + run_id, key
        self.nonce: str | None = None  # this launch's (mingpt.cli.launch_id), set before the handler uses it
        self._good, self._seq, self._warned = None, 0, False
        self._call("compare_set", self._name, "", _SENTINEL)

    @property
    def name(self) -> str:
        return "mingpt"

    def _call(self, op: str, *args):
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise RendezvousConnectionError(f"the rendezvous store failed ({op})") from e

    def _tag(self, head: bytes, state: bytes) -> bytes:
        return hmac.new(self._key, self._name.encode() + b"\0" + head + b"\0" + state, hashlib.sha256).digest()

    def _seal(self, state: bytes) -> bytes:
        head = json.dumps({"nonce": self.nonce, "seq": self._seq + 1, "t": time.time()}).encode()
        return base64.b64encode(self._tag(head, state) + len(head).to_bytes(4, "big") + head + state)

    def _read(self, raw: bytes) -> tuple[dict, bytes] | None:
        """The header and state of a value signed by a member of the job and written lately; None if not."""
        try:
            sealed = base64.b64decode(raw, validate=True)
            tag, size = sealed[:TAG], int.from_bytes(sealed[TAG:TAG + 4], "big")
            head, state = sealed[TAG + 4:TAG + 4 + size], sealed[TAG + 4 + size:]
            if len(tag) < TAG or not hmac.compare_digest(tag, self._tag(head, state)):
                return None
            header = json.loads(head)
            fresh = time.time() - float(header["t"]) <= FRESH_S and isinstance(header["seq"], int)
        except (ValueError, TypeError, KeyError):
            return None
        return (header, state) if fresh else None

    def live_nonce(self) -> str | None:
        """The nonce of the launch that wrote the store's state lately: a running launch that this agent joins."""
        raw = self._call("get", self._name)
        found = None if raw == _SENTINEL.encode() else self._read(raw)
        return None if found is None else found[0]["nonce"]

    def _open(self, raw: bytes) -> bytes:
        """The state of the store's value, or the last good one (an empty state if none) when it is not ours."""
        found = self._read(raw)
        if found is not None and found[0]["nonce"] == self.nonce and found[0]["seq"] >= self._seq:
            self._good, self._seq = found[1], found[0]["seq"]
            return found[1]
        if not self._warned:
            self._warned = True
            log.warning("the rendezvous state in the store is not one this launch wrote lately (forged, replayed or "
                        "another launch's): it is ignored and replaced at the next write")
        return self._good if self._good is not None else pickle.dumps(_RendezvousState())

    def get_state(self):
        raw = self._call("get", self._name)
        # the token is the raw value, whatever it is: the handler's next write replaces it
        return None if raw == _SENTINEL.encode() else (self._open(raw), raw)

    def set_state(self, state: bytes, token=None):
        sealed = self._seal(state)
        found = self._call("compare_set", self._name, token or _SENTINEL, sealed)
        if found != sealed and found != _SENTINEL.encode() and self._read(found) is None:  # a forgery in the way
            found = self._call("compare_set", self._name, found, sealed)
        if found == _SENTINEL.encode():
            return None
        return self._open(found), found, found == sealed


def _store(params: RendezvousParameters, timeout: timedelta):
    """The rendezvous store: hosted here, on the endpoint's address only, if that address is this
    machine's and no other agent here hosts it yet (or is_host says so); otherwise a client of it."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    is_host = params.get_as_bool("is_host")
    if is_host is not False:
        try:
            store = bound_store(host, port, True, timeout, multi_tenant=True, wait_for_workers=False)
            _say_who_hosts(params.endpoint, port, True)
            return store
        except OSError:  # not this machine's address, or the port is taken (another agent here hosts it)
            if is_host:
                raise
    store = bound_store(host, port, False, timeout)
    if is_host is None:  # is_host=0 names a store of its own (mingpt-rendezvous): nothing to warn of
        _say_who_hosts(params.endpoint, port, False)
    return store


def _say_who_hosts(endpoint: str, port: int, here: bool) -> None:
    """One line at the start of a job of several nodes: which agent hosts the rendezvous store, and
    that the job ends with it (port 0: --standalone, one node, nothing to say)."""
    if port == 0:
        return
    who = ("this agent hosts the rendezvous store at " + endpoint if here else
           f"the rendezvous store at {endpoint} is hosted by the agent started first there (or by mingpt-rendezvous)")
    print(f"mingpt-torchrun: {who}: if that agent stops, the job stops on every node (a store of its own, "
          "mingpt-rendezvous, removes that single point: docs/multi-node.md)", file=sys.stderr, flush=True)


def create(params: RendezvousParameters):
    """torchrun's handler for --rdzv_backend=mingpt."""
    secret = job_secret()
    if secret is None:
        raise SecretError(f"--rdzv_backend=mingpt needs the job's secret, the same on every node: set {SECRET_ENV}, "
                          f"or {SECRET_FILE_ENV} to a file only you can read (see the README: two machines)")
    try:
        store = PrefixStore(derive(secret, "rendezvous"), _store(params, timedelta(seconds=params.get_as_int(
            "read_timeout", 60))))
        backend = SignedBackend(store, params.run_id, derive(secret, "state").encode())
    except (OSError, RuntimeError, ValueError, TimeoutError) as e:
        raise RendezvousConnectionError(f"cannot reach the rendezvous store at {params.endpoint}") from e
    # The running launch's nonce, or a new one: what this launch signs is bound to it.
    backend.nonce = agreed_nonce(store, secret, params.run_id, backend.live_nonce)
    # The workers inherit the agent's environment: their own store, the secret to prefix it, the launch's id,
    # and their agent's pid (this handler runs in the agent, before it starts them): under plain torchrun
    # too, a worker whose agent died while it started exits at once (mingpt/runtime/orphan.py).
    os.environ.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", SECRET_ENV: secret.decode(),
                       "MINGPT_LAUNCH_ID": launch_id(secret, backend.nonce), AGENT_ENV: f"{os.getpid()}:{params.run_id}"})
    # torch's agents take the workers' store address (MASTER_ADDR, MASTER_PORT) and their ranks from the
    # handler's store: signed with a key of this launch, so that a value written by anyone else, or
    # recorded from another launch, is ignored.
    return create_handler(SignedStore(store, derive(secret, f"values/{backend.nonce}").encode()), backend, params)


def handler():
    """The `torchrun.handlers` entry point: torchrun calls it and registers what it returns."""
    return create


def serve(host: str, port: int, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Host a rendezvous store on host:port (that address only) until `stop` is set (or forever).
    The jobs sign what they read from it: it needs no secret itself."""
    store = bound_store(host, port, True, timedelta(seconds=60), multi_tenant=True, wait_for_workers=False)
    log.info("rendezvous store listening on %s:%d", host, store.port)
    if ready is not None:
        ready.set()
    (stop or threading.Event()).wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mingpt-rendezvous", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True, help="the address to listen on: the one the nodes reach this machine at")
    ap.add_argument("--port", type=int, default=29400)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    serve(args.host, args.port, stop=stop)


if __name__ == "__main__":
    main()
