"""mingpt.replicas.standby: a member's lock on its node, held by one process at a time, taken by the
spare the moment the holder dies."""

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import NOBODY, as_nobody

from mingpt.replicas import ReplicaError
from mingpt.replicas.standby import MemberLock, lock_path, release

SECRET = b"unit-test-secret-0123456789abcdef0123"
HOLD = ("import sys, time; from mingpt.replicas.standby import MemberLock; "
        "lock = MemberLock(sys.argv[1].encode(), 1, sys.argv[2]); print(lock.take(), flush=True); time.sleep(60)")


def test_a_second_process_stands_by_until_the_holder_is_killed_then_takes_the_member(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, SECRET.decode(), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        spare = MemberLock(SECRET, 1, str(tmp_path))
        assert not spare.take()  # the member runs: this process is its spare
        assert not spare.wait(lambda: True)  # told to stop: gives up without the lock
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        t = time.monotonic()
        assert spare.wait(lambda: time.monotonic() - t > 10)  # the kernel dropped the dead holder's lock
        assert MemberLock(SECRET, 1, str(tmp_path)).take()  # this process holds it now (a second run here too)
        assert MemberLock(SECRET, 1, str(tmp_path)).path != MemberLock(SECRET, 2, str(tmp_path)).path
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_spare_stopped_while_standing_by_leaves_as_a_replica_process_does_with_75(tmp_path, monkeypatch, caplog):
    """Process 1 of group 1's second torchrun (its member, 3, runs in another process): it stands by, named by
    its place in its torchrun, builds no Replicas, and, stopped (SIGTERM), leaves with the one exception of a
    replica process that exits (main.py reports it): 75 and a line that says nothing was trained."""
    from types import SimpleNamespace

    from mingpt.config.compose import compose
    from mingpt.replicas import ReplicaExit
    from mingpt.runtime.distributed import DistInfo
    from mingpt.runtime.exits import Exit, PreemptionFlag
    from mingpt.training.ledger import Ledger
    from mingpt.training.replica_launch import ReplicaLaunch, as_member

    secret, runtime = secrets.token_hex(32), tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("MINGPT_JOB_SECRET", secret)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    hold = ("import sys, time; from mingpt.replicas.standby import MemberLock; "
            "print(MemberLock(sys.argv[1].encode(), 3).take(), flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, secret], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        cfg = compose(["replicas.peers=[127.0.0.1:1,127.0.0.1:2]", "replicas.group=1"])
        info = as_member(cfg, DistInfo(world_size=2, local_world_size=2, local_rank=1))
        assert (info.local_rank, info.world_size, info.torchrun.local_rank) == (0, 1, 1)  # a member of its own
        launch = ReplicaLaunch(cfg, info)
        assert launch.spare is not None and launch.replicas is None  # nothing listens yet
        stopped = PreemptionFlag()
        stopped.signum = signal.SIGTERM
        with caplog.at_level("INFO"), pytest.raises(ReplicaExit) as left:
            launch.stand_by(cfg, info, None, SimpleNamespace(store=None), Ledger(), stopped)
    finally:
        holder.kill()
    assert left.value.code == Exit.PREEMPTED
    assert str(left.value) == "replica group 1 process 1's spare stopped while standing by (it trained nothing: nothing to save)"
    assert "replica group 1 process 1 runs on this node already: this process stands by as its spare" in caplog.text


def test_the_lock_lives_in_a_directory_of_this_user_alone_named_by_the_secret(tmp_path):
    path = lock_path(SECRET, 0, str(tmp_path))
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(path.parent.parent).st_mode) == 0o700
    assert SECRET.decode() not in path.name and path != lock_path(b"another-secret-0123456789abcdef0123", 0, str(tmp_path))
    MemberLock(SECRET, 0, str(tmp_path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path.parent, 0o755)  # opened to others (by hand): never used, the lock goes elsewhere
    assert lock_path(SECRET, 0, str(tmp_path)).parent.name.startswith(f"mingpt-{os.getuid()}-")


@pytest.fixture
def temp_folder():
    """A temp folder like /tmp (every user may make names in it, sticky), that another user can reach."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="mingpt-test-temp-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


def test_another_users_folder_at_the_predictable_name_never_ends_the_job(temp_folder, caplog):
    """`nobody` makes mingpt-<uid> first in the temp folder: every replica process of the user exited 2
    ("... belongs to uid 65534"), never restarted. Now the locks go to a folder named from the secret,
    with one warning, and the holder and its spare still find the same lock."""
    squat = temp_folder / f"mingpt-{os.getuid()}"
    subprocess.run(["mkdir", "-m", "700", str(squat)], preexec_fn=as_nobody(), check=True)
    assert squat.stat().st_uid == NOBODY
    path = lock_path(SECRET, 1, str(temp_folder))
    assert squat not in path.parents and path.parent.parent == temp_folder and path.parent.stat().st_uid == os.getuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"belongs to uid {NOBODY}" in said[0] and str(path.parent) in said[0]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, SECRET.decode(), str(temp_folder)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert MemberLock(SECRET, 1, str(temp_folder)).path == path
        assert not MemberLock(SECRET, 1, str(temp_folder)).take()  # the same lock: this process is the spare
    finally:
        holder.kill()
        holder.wait()
    # the other name too (seen in a listing, the folder since removed): one line, no traceback
    shutil.rmtree(path.parent)
    subprocess.run(["mkdir", "-m", "700", str(path.parent)], preexec_fn=as_nobody(), check=True)
    with pytest.raises(ReplicaError, match=f"lock cannot be kept on this node: .*belongs to uid {NOBODY}"):
        lock_path(SECRET, 1, str(temp_folder))


def test_the_lock_lives_in_the_users_runtime_folder_where_it_is_private(tmp_path, monkeypatch):
    """$XDG_RUNTIME_DIR (/run/user/<uid>): nobody else can make a name there; used when it is private."""
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert lock_path(SECRET, 2).parent == runtime / "mingpt-replicas"
    runtime.chmod(0o755)  # not private: the temp folder's, as without it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    assert lock_path(SECRET, 2).parent == tmp_path / "temp" / f"mingpt-{os.getuid()}" / "replicas"


def test_the_holder_removes_the_lock_file_at_the_runs_end_and_nobody_else_does(tmp_path):
    path = lock_path(SECRET, 3, str(tmp_path))
    MemberLock(SECRET, 3, str(tmp_path))
    release(SECRET, 3, str(tmp_path))  # not held by this process: left for its holder
    assert path.exists()
    assert MemberLock(SECRET, 3, str(tmp_path)).take()
    release(SECRET, 3, str(tmp_path))
    assert not path.exists()
