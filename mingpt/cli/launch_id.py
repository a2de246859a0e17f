"""One launch, one id: MINGPT_LAUNCH_ID for `--rdzv_backend=mingpt`.

The id tells one launch of a job from the next (the store's lease, "a restart resumes its own
snapshots"), so it may not come from the secret alone: users reuse a secret, and its rendezvous id,
for several launches (a SLURM requeue rereads the job's secret file and uses the job id). The first
agent of a launch makes a random nonce and offers it to the rendezvous store with compare_set (the
first writer wins); every other agent of the launch, on any node, reads the winner's, and an agent
that joins later takes the nonce of the rendezvous state the launch keeps writing
(mingpt.cli.rendezvous.SignedBackend). torchrun restarts the workers of an agent with the environment
it set once, so a restart keeps the id. The nonce is signed with a key derived from the secret, with
the time it was made: a nonce that is not signed, or was made longer ago than FRESH_S (a recording of
an earlier launch planted in this one's store), is replaced by this agent's own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from mingpt.runtime.trust import SecretError, derive

FRESH_S = 30.0  # as mingpt.cli.rendezvous.FRESH_S: the agents of one launch start within it of the first one
_TRIES = 20  # replacements of a forged or stale nonce before giving up: someone keeps writing it


def agreed_nonce(store, secret: bytes, run_id: str, live: Callable[[], str | None] = lambda: None) -> str:
    """This launch's nonce, the same for every agent of the rendezvous `run_id` in `store` (a store whose
    keys are named by the secret), different for the next launch with the same secret. `live`: the
    nonce of the launch whose rendezvous state is in the store and was written lately, if any."""
    if (running := live()) is not None:
        return running
    key = derive(secret, f"launch-nonce/{run_id}")
    offered, expected = _sealed(secret, run_id, secrets.token_hex(16), time.time()), ""
    for _ in range(_TRIES):
        try:
            found = store.compare_set(key, expected, offered)  # the value now stored: ours if we came first
        except (OSError, RuntimeError, TimeoutError) as e:
            raise RendezvousConnectionError("cannot agree on the launch id through the rendezvous store") from e
        found = found.decode(errors="replace") if isinstance(found, bytes) else found
        nonce, made = _opened(secret, run_id, found)
        if nonce is not None and (found == offered or time.time() - made <= FRESH_S):
            return nonce
        expected = found  # forged, or a recording of an earlier launch: replaced by ours
    raise SecretError("the launch nonce in the rendezvous store is not signed with this job's secret or is a recording "
                      "of an earlier launch, again and again: a process outside the job keeps writing it, or the nodes "
                      "were given different secrets")


def launch_id(secret: bytes, nonce: str) -> str:
    return derive(secret, f"launch{nonce}")[:16]


def _sealed(secret: bytes, run_id: str, nonce: str, made: float) -> str:
    key = derive(secret, "launch-nonce-signature").encode()
    return f"{nonce}:{made!r}:{hmac.new(key, f'{run_id}:{nonce}:{made!r}'.encode(), hashlib.sha256).hexdigest()}"


def _opened(secret: bytes, run_id: str, value: str) -> tuple[str | None, float]:
    """The nonce and the time it was made of a signed value; (None, 0) if it is not signed with the secret."""
    nonce, _, rest = value.partition(":")
    made, _, _ = rest.partition(":")
    try:
        ok = hmac.compare_digest(_sealed(secret, run_id, nonce, float(made)).encode(), value.encode())
    except ValueError:
        return None, 0.0
    return (nonce, float(made)) if ok else (None, 0.0)
