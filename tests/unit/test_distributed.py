"""torchrun's environment, read once (mingpt/runtime/distributed.py): DistInfo, launch ids, the job's secret."""

import hashlib
import os
import secrets

import pytest
import torch

from mingpt.runtime.distributed import DistInfo, default_threads, init
from mingpt.runtime.trust import SecretError, job_secret


def test_dist_info_from_env_without_process_group():
    info = DistInfo.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                              "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"}, cuda=False)
    assert (info.rank, info.local_rank, info.world_size, info.restart_count) == (3, 1, 4, 2)
    assert info.device == "cpu" and info.backend == "gloo" and not info.is_rank0
    gpu = DistInfo.from_env({"LOCAL_RANK": "1"}, cuda=True)
    assert gpu.device == "cuda:1" and gpu.backend == "nccl"
    plain = DistInfo.from_env({}, cuda=False)
    assert plain.is_rank0 and not plain.distributed and plain.job_id is None
    # the rendezvous id names the job across restarts; torchrun's default "none" names no job
    assert DistInfo.from_env({"TORCHELASTIC_RUN_ID": "job7"}, cuda=False).job_id == "job7"
    assert DistInfo.from_env({"TORCHELASTIC_RUN_ID": "none"}, cuda=False).job_id is None
    assert default_threads(2) >= 1 and default_threads(1) >= default_threads(2)


def test_launch_id_from_the_launcher_else_torchrun_else_this_process():
    env = {"TORCHELASTIC_RUN_ID": "run1", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert DistInfo.from_env({**env, "MINGPT_LAUNCH_ID": "l1"}, cuda=False).launch_id == "l1"
    assert DistInfo.from_env(env, cuda=False).launch_id == "run1" and not DistInfo.from_env(env, cuda=False).restarted
    assert DistInfo.from_env({**env, "TORCHELASTIC_RESTART_COUNT": "2"}, cuda=False).restarted
    # torchrun's default id "none" and plain python: every start is a launch of its own
    assert len({DistInfo.from_env(e, cuda=False).launch_id for e in ({}, {}, {"TORCHELASTIC_RUN_ID": "none"})}) == 3


@pytest.mark.parametrize("value, fix", [
    ("short", "has 5 characters: use at least 32"),
    ("a" * 32, "only 1 distinct characters"),
    ("password" * 4, "only 7 distinct characters"),
    ("0123456789abcdef" * 2, "repeats a pattern of 16 characters"),
    ("correct horse battery staple, twice", "neither hex nor base64"),
    ("Zm9vYmFyYmF6cXV4", "has 16 characters"),  # base64 of 12 bytes: 96 bits
    ("0123456789abcdeffedcba9876543210", r"is mostly runs \(in 29 of its 32"),  # a person's: 16 characters, no period
    (hashlib.sha256(b"password").hexdigest(), "is the sha256 of 'password'"),
    (hashlib.md5(b"secret\n").hexdigest().upper(), "is the md5 of 'secret' and a newline"),  # echo secret | md5sum
])
def test_a_guessable_secret_is_refused_with_how_to_make_a_good_one(value, fix):
    with pytest.raises(SecretError, match=fix) as e:
        job_secret({"MINGPT_JOB_SECRET": value})
    assert "mingpt-torchrun --new-secret FILE" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("make", [secrets.token_hex, secrets.token_urlsafe, lambda n: secrets.token_hex(n).upper(),
                                  lambda n: __import__("base64").b64encode(secrets.token_bytes(n)).decode()])
def test_random_secrets_of_128_bits_or_more_are_accepted(make):
    for _ in range(50):
        value = make(16)
        assert job_secret({"MINGPT_JOB_SECRET": value}) == value.encode()


def test_a_secret_file_must_be_a_regular_file(tmp_path):
    """A directory or a FIFO (which would block the open) named as the secret file: one line."""
    os.mkfifo(tmp_path / "fifo", 0o600)
    for path in (tmp_path, tmp_path / "fifo"):
        with pytest.raises(SecretError, match="is not a regular file"):
            job_secret({"MINGPT_JOB_SECRET_FILE": str(path)})


@pytest.mark.parametrize("mode, fix", [(0o644, "chmod 600"), (None, "at least 32")])
def test_a_secret_others_can_read_or_guess_is_refused_with_the_fix(tmp_path, mode, fix):
    path = tmp_path / "job.secret"
    path.write_text(secrets.token_hex(32) if mode else "short")
    path.chmod(mode or 0o600)
    with pytest.raises(SecretError, match=fix):
        job_secret({"MINGPT_JOB_SECRET_FILE": str(path)})
    path.chmod(0o600)
    if mode:
        assert len(job_secret({"MINGPT_JOB_SECRET_FILE": str(path)})) == 64


def test_deterministic_kernels_are_switched_on_with_cublas_fixed_before_first_use(monkeypatch):
    """trainer.deterministic: on an H200 two fault-free bf16 runs differed by up to 1.5e-2 in a weight
    without it and were bitwise equal with it (docs/performance.md); CPU runs are deterministic."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        init(DistInfo.from_env({}, cuda=False), 10, threads=torch.get_num_threads())
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        init(DistInfo.from_env({}, cuda=False), 10, threads=torch.get_num_threads(), deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(("message", "said"), [
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:40562: Connection reset by peer",
     "lost host localhost, ranks 2, 3 (127.0.0.1) during a collective: its connection was reset"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:525] Connection closed by peer [10.9.8.7]:35112",
     "the peer at 10.9.8.7 was lost during a collective (it closed its connection)"),
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
     "operation to complete", "a peer was lost during a collective (it did not answer in time)"),
])
def test_a_lost_peer_is_named_in_our_words_by_host_and_rank(message, said):
    from mingpt.runtime.distributed import lost_peer

    out = lost_peer(RuntimeError(message), ["nohost.invalid:0", "localhost:0", "localhost:1", "localhost:2"],
                    me=1)  # this rank shares the peers' address: it is not named
    assert out == said
    assert "pair.cc" not in out and "GLHF" not in out


def test_two_nodes_on_one_host_are_named_apart_and_their_slowest_rank_too(caplog):
    """Two torchrun agents on one machine (loopback nodes), each with local ranks 0 and 1: "host:local_rank"
    named two processes as one ("vm:0"), in the records, the report and the slowest-rank log line."""
    import logging

    from mingpt.report.summary import Run
    from mingpt.runtime.distributed import lost_peer, rank_names
    from mingpt.training.metrics import train_record

    names = rank_names([("vm", 0, 0), ("vm", 0, 1), ("vm", 1, 0), ("vm", 1, 1)])
    assert names == ["vm:0 (node 0)", "vm:1 (node 0)", "vm:0 (node 1)", "vm:1 (node 1)"]
    assert rank_names([("a", 0, 0), ("a", 0, 1), ("b", 1, 0)]) == ["a:0", "a:1", "b:0"]  # a node per host: as before
    step = {"step": 5, "tokens_seen": 50, "tokens": 10, "lr": 1e-3, "grad_norm": 1.0}
    with caplog.at_level(logging.INFO):
        record = train_record(step, 2.0, 0.1, [0.01, 0.01, 0.03, 0.01], names, 1.0, 1e9)
    assert "slowest vm:0 (node 1), rank 2" in caplog.text
    start = {"kind": "start", "step": 0, "hosts": names}
    slow = Run.of([start, record, {**record, "step": 10}]).slowest(top=4)
    assert len(slow) == 4 and slow[0][0] == "vm:0 (node 1)", slow  # four processes, the slow one apart
    said = lost_peer(RuntimeError("Connection reset by peer [127.0.0.1]:35112"), ["localhost:0 (node 1)"])
    assert said.startswith("lost host localhost, rank 0 ")  # the host is still read from the name
