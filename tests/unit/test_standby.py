"""mingpt.replicas.standby: a member's lock on its node, held by one process at a time, taken by the
spare the moment the holder dies."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

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


def test_the_lock_lives_in_a_directory_of_this_user_alone_named_by_the_secret(tmp_path):
    path = lock_path(SECRET, 0, str(tmp_path))
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(path.parent.parent).st_mode) == 0o700
    assert SECRET.decode() not in path.name and path != lock_path(b"another-secret-0123456789abcdef0123", 0, str(tmp_path))
    MemberLock(SECRET, 0, str(tmp_path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path.parent, 0o755)  # opened to others (by hand, or a directory planted in its place): refused
    with pytest.raises(ReplicaError, match="lock cannot be kept on this node: .* open to other users"):
        lock_path(SECRET, 0, str(tmp_path))


def test_the_holder_removes_the_lock_file_at_the_runs_end_and_nobody_else_does(tmp_path):
    path = lock_path(SECRET, 3, str(tmp_path))
    MemberLock(SECRET, 3, str(tmp_path))
    release(SECRET, 3, str(tmp_path))  # not held by this process: left for its holder
    assert path.exists()
    assert MemberLock(SECRET, 3, str(tmp_path)).take()
    release(SECRET, 3, str(tmp_path))
    assert not path.exists()
