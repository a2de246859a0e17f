"""The signed rendezvous (mingpt/cli/rendezvous.py): a state not signed with the job's secret is refused
before it is unpickled, and the rendezvous store listens on the chosen address only.
The launch against another user of the node is scenarios/test_launch_security.py."""

import datetime
import os
import pickle
import secrets
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, Payload, forged_state, free_port

from mingpt.cli.rendezvous import SignedBackend

time_now = time.time


def test_a_state_not_signed_for_this_launch_is_ignored_before_it_is_unpickled_and_replaced(tmp_path, caplog):
    """A value of the state key that is not a state this launch signed (a code-running pickle, a state
    of another secret, one of another launch with the same secret, a recording older than FRESH_S) is
    never unpickled and does not end the job: the agent goes on with its last good state, and its
    next write replaces the value."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    key = secrets.token_bytes(32)
    ours = SignedBackend(store, "run1", key)
    ours.nonce = "a" * 32
    state, token, written = ours.set_state(b"a state of ours")
    assert written and ours.get_state()[0] == b"a state of ours"
    other_job = SignedBackend(store, "run1", secrets.token_bytes(32))  # another secret
    other_launch = SignedBackend(store, "run1", key)  # the same secret, another launch
    other_job.nonce, other_launch.nonce = ours.nonce, "b" * 32
    with patch("time.time", lambda: time_now() - 60):
        recorded = ours._seal(b"a recording of ours")
    for planted in (forged_state(tmp_path / "pwned"), b"not base64 !",
                    other_job._seal(pickle.dumps(Payload(str(tmp_path / "pwned")))),
                    other_launch._seal(pickle.dumps(Payload(str(tmp_path / "pwned")))), recorded):
        store.set("torch.rendezvous.run1", planted)  # someone who can name the key
        state, token = ours.get_state()
        assert state == b"a state of ours"
        state, token, written = ours.set_state(b"the next state", token)
        assert written and state == b"the next state" and ours.get_state()[0] == b"the next state"
        ours.set_state(b"a state of ours", token)
    assert not (tmp_path / "pwned").exists()
    assert "not one this launch wrote lately" in caplog.text


def test_a_new_agent_that_finds_a_forged_state_starts_its_own():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    ours = SignedBackend(store, "run1", secrets.token_bytes(32))
    ours.nonce = "a" * 32
    store.set("torch.rendezvous.run1", b"garbage")
    state, token = ours.get_state()
    assert pickle.loads(state).round == 0
    assert ours.set_state(b"ours", token)[2] and ours.get_state()[0] == b"ours"


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


def _raw_client(port: int) -> dist.TCPStore:
    """What anyone who reaches the port has: a plain client, no secret."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))


def test_the_agents_store_address_is_signed_and_a_forged_one_is_ignored(monkeypatch, caplog):
    """torch's agents take MASTER_ADDR / MASTER_PORT (the workers' store) from the handler's store. Anyone
    who reaches the port finds those keys with list_keys() and can overwrite them: the handler's store
    ignores the forgery, keeps the value it wrote and says which key was forged."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    from mingpt.cli.rendezvous import create

    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MINGPT_LAUNCH_ID", "MINGPT_JOB_SECRET_FILE", "MINGPT_AGENT_PID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secrets.token_hex(32))
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as create() sets it
    port = free_port()
    params = RendezvousParameters("mingpt", f"127.0.0.1:{port}", "run1", 1, 1, last_call_timeout=1,
                                  read_timeout=2)
    handler = create(params)  # it hosts the store: kept alive to the end
    info = handler.next_rendezvous()
    genuine = info.bootstrap_store_info
    keys = {k.rsplit("/", 1)[-1]: k for k in _raw_client(port).list_keys()}
    assert {"MASTER_ADDR", "MASTER_PORT"} <= keys.keys()  # the prefix hides nothing
    _raw_client(port).set(keys["MASTER_ADDR"], b"attacker.example")
    _raw_client(port).set(keys["MASTER_PORT"], b"not-a-port")
    with caplog.at_level("WARNING"):
        again = RendezvousStoreInfo.build(1, info.store, None)  # what another node's agent does
    assert (again.master_addr, again.master_port) == (genuine.master_addr, genuine.master_port)
    assert "MASTER_PORT is not signed with this job's secret" in caplog.text


def _signed(port: int, secret: bytes, timeout_s: float):
    """The handler's store as create() makes it, client side, under the round's prefix torch adds, and
    the SignedStore itself: a Python store must be kept alive by Python (a PrefixStore does not)."""
    from mingpt.runtime.trust import SignedStore, derive

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    signed = SignedStore(dist.PrefixStore(derive(secret, "rendezvous"), client), derive(secret, "values").encode())
    return dist.PrefixStore("torch.rendezvous.run1.0", signed), signed


def test_a_reader_with_no_good_value_waits_for_a_signed_one_then_refuses_in_one_line():
    import threading

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))
    secret = secrets.token_hex(32).encode()
    (writer, _w), (reader, _r) = _signed(port, secret, 5), _signed(port, secret, 1)
    writer.set("MASTER_ADDR", "10.0.0.1")
    key = next(k for k in host.list_keys() if k.endswith("/MASTER_ADDR"))
    host.set(key, b"10.6.6.6")  # forged before the other node read it: nothing good to keep
    started = time.monotonic()
    with pytest.raises(Exception, match=r"MASTER_ADDR was not signed with this job's secret for 1 s") as e:
        reader.get("MASTER_ADDR")
    assert "\n" not in str(e.value) and 0.9 < time.monotonic() - started < 5
    # a genuine value written while the reader waits is the one it reads
    threading.Timer(0.3, lambda: writer.set("MASTER_ADDR", "10.0.0.2")).start()
    fresh = _signed(port, secret, 5)
    assert fresh[0].get("MASTER_ADDR") == b"10.0.0.2"
    # a value signed with another job's secret, under this job's key, is no better than a forged one
    from mingpt.runtime.trust import SignedStore, derive

    client = _raw_client(port)
    stranger = SignedStore(dist.PrefixStore(derive(secret, "rendezvous"), client),
                           derive(secrets.token_hex(32).encode(), "values").encode())
    dist.PrefixStore("torch.rendezvous.run1.0", stranger).set("MASTER_ADDR", "10.6.6.6")
    with pytest.raises(Exception, match="not signed with this job's secret"):
        reader.get("MASTER_ADDR")


def test_the_signed_store_passes_everything_else_through_under_torchs_prefix():
    """What the dynamic handler and the agent call on the store (torch 2.13): counters and markers
    unsigned, the agents' ranks signed, timeouts set through PrefixStore reaching the connection."""
    from torch.distributed.elastic.utils import store as store_util

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))
    store, signed = _signed(port, secrets.token_hex(32).encode(), 5)
    assert store.add("count", 2) == 2 and store.add("count", 1) == 3
    assert store.compare_set("state", "", "v1") == b"v1" and store.get("state") == b"v1"
    store.multi_set(["torchelastic/assigned_ranks/0", "plain"], ["[0, 2, 0, 2]", "p"])
    assert store.multi_get(["torchelastic/assigned_ranks/0", "plain"]) == [b"[0, 2, 0, 2]", b"p"]
    raw = {k.split("torch.rendezvous.run1.0/", 1)[1]: host.get(k) for k in host.list_keys()}
    assert raw["plain"] == b"p" and raw["torchelastic/assigned_ranks/0"].endswith(b"[0, 2, 0, 2]")
    assert len(raw["torchelastic/assigned_ranks/0"]) == 32 + len(b"[0, 2, 0, 2]")  # the tag, then the value
    store.wait(["plain"])
    store.wait(["plain"], datetime.timedelta(seconds=1))
    assert store.check(["plain"]) and not store.check(["absent"])
    assert store.delete_key("plain") and not store.check(["plain"])
    assert store.num_keys() >= 3
    store_util.barrier(store, 1, "exit", barrier_timeout=3)  # the agent's exit barrier
    with store_util.store_timeout(store, 1):
        assert store.timeout == datetime.timedelta(seconds=1)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            store.get("never")
        assert time.monotonic() - started < 4  # the timeout reached the connection (5 s there)
    assert store.timeout == datetime.timedelta(seconds=5)


def test_every_launch_has_its_own_id_the_same_for_every_agent_of_it(monkeypatch):
    """Users reuse a secret for several launches: the launch id (the store's lease, "a restart resumes
    its own snapshots") comes from a nonce that the launch's first agent puts in its rendezvous store."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from mingpt.cli.rendezvous import create

    for name in ("MINGPT_LAUNCH_ID", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MINGPT_JOB_SECRET_FILE", "MINGPT_AGENT_PID"):
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


def test_a_launch_nonce_not_signed_with_the_jobs_secret_is_replaced():
    from mingpt.cli.launch_id import agreed_nonce
    from mingpt.runtime.trust import derive

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    secret = secrets.token_hex(32).encode()
    store.set(derive(secret, "launch-nonce/run1"), "00" * 16 + ":1.0:" + "11" * 32)  # someone who could name the key
    nonce = agreed_nonce(store, secret, "run1")
    assert nonce != "00" * 16 and agreed_nonce(store, secret, "run1") == nonce


def test_a_launch_that_finds_the_recorded_values_of_an_earlier_launch_keeps_its_own_id(monkeypatch, tmp_path):
    """A SLURM requeue starts the same job again: the same secret and --rdzv_id. Whoever recorded the
    first attempt's store (its launch nonce, rendezvous state and agents' values, all signed) and
    plants them in the next attempt's store before its agents come gets nothing: they are refused, the
    new launch has its own id (so snapshot.resume=never stays a fresh start), and a recorded store
    address is never taken."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from mingpt.cli.rendezvous import create

    for name in ("MINGPT_LAUNCH_ID", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MINGPT_JOB_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secrets.token_hex(32))
    first_port, second_port = free_port(), free_port()
    # the first attempt, a minute ago (its clock set back: what a requeue's gap is)
    with patch("time.time", lambda: time_now() - 60):
        handler = create(RendezvousParameters("mingpt", f"127.0.0.1:{first_port}", "run1", 1, 1,
                                              last_call_timeout=1))
        handler.next_rendezvous()
        first = os.environ["MINGPT_LAUNCH_ID"]
        handler._stop_heartbeats()
    old = dist.TCPStore("127.0.0.1", first_port, is_master=False, timeout=datetime.timedelta(seconds=5))
    recorded = {k: old.get(k) for k in old.list_keys() if not k.startswith("/")}
    assert any(k.endswith("torch.rendezvous.run1") for k in recorded) and any("MASTER_ADDR" in k for k in recorded)
    # the next attempt's store, with the recording planted before its first agent comes
    new = dist.TCPStore("127.0.0.1", second_port, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=10), multi_tenant=True)
    for k, v in recorded.items():
        new.set(k, v)
    handler = create(RendezvousParameters("mingpt", f"127.0.0.1:{second_port}", "run1", 1, 1, last_call_timeout=1))
    again = os.environ["MINGPT_LAUNCH_ID"]
    assert again != first
    info = handler.next_rendezvous()
    handler._stop_heartbeats()
    assert info.bootstrap_store_info.master_port not in (None, first_port)  # its own values, not the recorded ones


def test_each_agent_says_at_start_which_agent_hosts_the_rendezvous_store(monkeypatch, capsys):
    """Before: nothing said which agent hosted it (the README's HOST1 is "either machine"), nor that the
    job ends with it."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from mingpt.cli.rendezvous import create

    for name in ("MINGPT_LAUNCH_ID", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MINGPT_JOB_SECRET_FILE", "MINGPT_AGENT_PID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secrets.token_hex(32))
    endpoint, held = f"127.0.0.1:{free_port()}", []

    def agent(endpoint: str, **conf) -> list[str]:
        held.append(create(RendezvousParameters("mingpt", endpoint, "run1", 1, 2, **conf)))
        return capsys.readouterr().err.splitlines()

    (first,) = agent(endpoint)
    assert first.startswith(f"mingpt-torchrun: this agent hosts the rendezvous store at {endpoint}: if that agent "
                            "stops, the job stops on every node (a store of its own, mingpt-rendezvous, removes")
    (second,) = agent(endpoint)
    assert second.startswith(f"mingpt-torchrun: the rendezvous store at {endpoint} is hosted by the agent started "
                             "first there (or by mingpt-rendezvous): if that agent stops, the job stops on every node")
    assert agent(endpoint, is_host="0") == []  # a store of its own (mingpt-rendezvous): nothing to warn of
    assert agent("127.0.0.1:0") == []  # --standalone: one node
