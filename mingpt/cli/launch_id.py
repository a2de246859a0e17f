"""One launch, one id: MINGPT_LAUNCH_ID for `--rdzv_backend=mingpt`.

The id tells one launch of a job from the next (the store's lease, "a restart resumes its own
snapshots"), so it may not come from the secret alone: users reuse a secret for several launches.
The first agent of a launch makes a random nonce and offers it to the rendezvous store with
compare_set (the first writer wins); every other agent of the launch, on any node, and every agent
that joins it later reads the winner's. torchrun restarts the workers of an agent with the
environment it set once, so a restart keeps the id; a new launch has a new rendezvous store and a
new nonce. The nonce is signed with a key derived from the secret and checked on read: only a member
of the job can choose it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from mingpt.runtime.trust import SecretError, derive


def agreed_launch_id(store, secret: bytes, run_id: str) -> str:
    """This launch's id, the same for every agent of the rendezvous `run_id` in `store` (a store
    whose keys are named by the secret), different for the next launch with the same secret."""
    key = derive(secret, f"launch-nonce/{run_id}")
    offered = _sealed(secret, run_id, secrets.token_hex(16))
    try:
        found = store.compare_set(key, "", offered)  # the value now stored: ours if we came first
    except (OSError, RuntimeError, TimeoutError) as e:
        raise RendezvousConnectionError("cannot agree on the launch id through the rendezvous store") from e
    nonce, _, tag = (found.decode() if isinstance(found, bytes) else found).partition(":")
    if not hmac.compare_digest(_sealed(secret, run_id, nonce), f"{nonce}:{tag}"):
        raise SecretError("the launch nonce in the rendezvous store is not signed with this job's secret: a process "
                          "outside the job wrote it, or the nodes were given different secrets")
    return derive(secret, f"launch{nonce}")[:16]


def _sealed(secret: bytes, run_id: str, nonce: str) -> str:
    key = derive(secret, "launch-nonce-signature").encode()
    return f"{nonce}:{hmac.new(key, f'{run_id}:{nonce}'.encode(), hashlib.sha256).hexdigest()}"
