"""The members of an epoch as a ring: a connection to each neighbour, and to another member only when
a step needs it. The exchange and the healing talk point to point over these (group.py); a gloo group
of all members connects every pair, which costs each member a socket per member and every epoch a
set-up that grows with them (gloo's lazy connections hang now and then: pytorch/gloo#444)."""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mingpt.runtime.trust import derive


def devices() -> list:
    """gloo's devices as its own default picks them: on the interfaces GLOO_SOCKET_IFNAME names, else
    on the address this host's name resolves to."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    return [dist.ProcessGroupGloo.create_device(interface=n) for n in names] or [dist.ProcessGroupGloo.create_default_device()]


class Rendezvous(dist.Store):
    """A member's rendezvous store as a pair sees it: a wait for a key polls for it, a short request at a
    time. A store client answers one request at a time, and gloo's rendezvous waits for its peer's address
    inside one: a member whose pair with one neighbour waited there had not yet published its address for
    the other pair, and three members, each waiting on the next, waited for the timeout (20 s in a test)."""

    def __init__(self, store, timeout: datetime.timedelta):
        super().__init__()
        self._inner, self._limit = store, timeout  # (a Store's `timeout` is its own, read-only)

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        self.wait([key])
        return self._inner.get(key)

    def add(self, key, value):
        return self._inner.add(key, value)

    def check(self, keys):
        return self._inner.check(keys)

    def wait(self, keys, timeout=None):
        limit = (timeout or self._limit).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while not self._inner.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {list(keys)}")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


class Ring:
    """This member's links to the other members of an epoch (`world` of them, this one rank `rank`):
    a gloo group of two for each pair that talks, made over the store of the pair's lower rank
    (`stores(rank)`: each member hosts its own, so none serves every pair) under a name derived from
    the job secret, all on one gloo device (one listener, one event loop). Both ends of a pair make it
    together; a member makes its pairs at once, so that none waits for a member busy making another first."""

    def __init__(self, stores: Callable[[int], dist.Store], secret: bytes, name: str, rank: int, world: int,
                 timeout: datetime.timedelta):
        self.stores, self.secret, self.name, self.timeout = stores, secret, name, timeout
        self.rank, self.world = rank, world
        self.pairs: dict[int, object] = {}  # the other rank -> the pair's gloo group
        self.devices: list | None = None  # one listener and one event loop for all the pairs

    def size(self) -> int:
        return self.world

    def neighbours(self) -> list[int]:
        """The ranks before and after this one round the ring."""
        return sorted({(self.rank - 1) % self.world, (self.rank + 1) % self.world} - {self.rank})

    def connect(self, peers) -> None:
        """Make the pairs with `peers` not made yet, all at once (each waits for its other end, which
        may be making its other pairs first)."""
        made: dict[int, object] = {}
        self.devices = self.devices or devices()

        def make(peer: int) -> None:
            low, high = min(peer, self.rank), max(peer, self.rank)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices, opts._threads, opts._timeout = self.devices, 1, self.timeout
            try:
                store = Rendezvous(self.stores(low), self.timeout)
                prefixed = dist.PrefixStore(derive(self.secret, f"{self.name}-pair-{low}-{high}"), store)
                made[peer] = dist.ProcessGroupGloo(prefixed, int(self.rank == high), 2, opts)
            except Exception as e:  # noqa: BLE001 - raised again by the caller's thread
                made[peer] = e

        threads = [threading.Thread(target=make, args=(p,), daemon=True)
                   for p in sorted(set(peers) - set(self.pairs) - {self.rank})]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for peer, pg in made.items():
            if isinstance(pg, Exception):
                raise pg
            self.pairs[peer] = pg

    def send(self, t: torch.Tensor, peer: int, tag: int):
        """Send `t` to rank `peer` (a pair made: `connect`): its work (wait on it)."""
        return self.pairs[peer].send([t], int(peer > self.rank), tag)

    def recv(self, t: torch.Tensor, peer: int, tag: int):
        """Receive into `t` from rank `peer` (a pair made: `connect`): its work (wait on it)."""
        return self.pairs[peer].recv([t], int(peer > self.rank), tag)
