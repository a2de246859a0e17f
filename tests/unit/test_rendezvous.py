"""The signed rendezvous (mingpt/cli/rendezvous.py): a state not signed with the job's secret is refused
before it is unpickled, and the rendezvous store listens on the chosen address only.
The launch against another user of the node is scenarios/test_launch_security.py."""

import base64
import datetime
import os
import pickle
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, Payload, forged_state, free_port
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from mingpt.cli.rendezvous import SignedBackend


def test_a_state_not_signed_with_the_jobs_secret_is_refused_before_it_is_unpickled(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    key = secrets.token_bytes(32)
    ours = SignedBackend(C10dRendezvousBackend(store, "run1"), key)
    state, token, written = ours.set_state(b"a state of ours")
    assert written and ours.get_state()[0] == b"a state of ours"
    store.set("torch.rendezvous.run1", forged_state(tmp_path / "pwned"))  # someone who can name the key
    with pytest.raises(RendezvousStateError, match="not signed with this job's secret"):
        ours.get_state()
    other_job = SignedBackend(C10dRendezvousBackend(store, "run1"), secrets.token_bytes(32))  # another secret
    store.set("torch.rendezvous.run1", base64.b64encode(other_job._seal(pickle.dumps(Payload(str(tmp_path / "pwned"))))))
    with pytest.raises(RendezvousStateError):
        ours.get_state()
    assert not (tmp_path / "pwned").exists()


def listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc shows them) listening on TCP `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_the_rendezvous_store_listens_on_the_chosen_address_only():
    """torchrun's rendezvous unpickles what it reads from the store: it must not listen on every
    interface (TCPStore itself binds all of them, whatever host it is given)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mingpt.cli.rendezvous", "--host", "127.0.0.1", "--port",
                               str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 30
        while not listeners(port):
            assert time.time() < deadline and server.poll() is None, server.communicate()[0]
            time.sleep(0.1)
        assert listeners(port) == ["0100007F"]  # 127.0.0.1, and nothing else
        from datetime import timedelta

        client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        server.terminate()
        server.wait(timeout=30)
    missing = subprocess.run([sys.executable, "-m", "mingpt.cli.rendezvous", "--port", str(port)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--host" in missing.stderr


def test_every_launch_has_its_own_id_the_same_for_every_agent_of_it(monkeypatch):
    """Users reuse a secret for several launches: the launch id (the store's lease, "a restart resumes
    its own snapshots") comes from a nonce that the launch's first agent puts in its rendezvous store."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from mingpt.cli.rendezvous import create

    for name in ("MINGPT_LAUNCH_ID", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MINGPT_JOB_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secrets.token_hex(32))
    held = []

    def agent(port: int) -> str:  # what an agent of the rendezvous at port gives its workers
        held.append(create(RendezvousParameters("mingpt", f"127.0.0.1:{port}", "run1", 1, 2)))
        return os.environ["MINGPT_LAUNCH_ID"]

    first_port, second_port = free_port(), free_port()
    first = agent(first_port)  # hosts the store
    assert agent(first_port) == first  # another node (or a node that rejoins) of the same launch
    again = agent(second_port)  # the next launch, same secret and run id
    assert len(first) == len(again) == 16 and again != first


def test_a_launch_nonce_not_signed_with_the_jobs_secret_is_refused():
    from mingpt.cli.launch_id import agreed_launch_id
    from mingpt.distributed import SecretError, derive

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    secret = secrets.token_hex(32).encode()
    store.set(derive(secret, "launch-nonce/run1"), "00" * 16 + ":" + "11" * 32)  # someone who could name the key
    with pytest.raises(SecretError, match="not signed with this job's secret"):
        agreed_launch_id(store, secret, "run1")
    assert agreed_launch_id(store, secret, "run2") == agreed_launch_id(store, secret, "run2")
