"""The job's secret and what it vouches for: the secret's rules, values derived from it, stores that
listen on one address, and store values signed with it.

Anyone who reaches a TCPStore's port can list its keys (`list_keys()`), read, overwrite and delete
any of them: a key prefix hides nothing. So every value the job takes on trust from a store is
signed here and checked where it is read; what cannot be signed (gloo's own keys) can only disrupt.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

# The per-job secret: every process of one job has it, nobody else. It keys the rendezvous state's
# signature (mingpt.cli.rendezvous) and the signed store values below, names the keys in the job's
# stores, and an id derived from it tells one launch of a job from the next. An environment variable
# is readable by its user only (/proc/PID/environ is 0400), unlike a command line; a file must be its
# user's, a regular file and mode 0600.
SECRET_ENV, SECRET_FILE_ENV = "MINGPT_JOB_SECRET", "MINGPT_JOB_SECRET_FILE"
MAKE_ONE = "mingpt-torchrun --new-secret FILE"
SECRET_BYTES = 16  # 128 bits
# What people hash to make a "random" secret: the md5, sha1, sha256 and sha512 (hex) of these, as
# typed and as `echo WORD | sha256sum` has them, are refused. Any other word's hash passes.
COMMON_WORDS = ("", "password", "secret", "123456", "12345678", "123456789", "qwerty", "letmein", "changeme",
                "admin", "root", "test", "mingpt", "password1", "welcome")


class SecretError(ValueError):
    """The job secret is missing, too short, guessable or readable by others; the message says how to fix it."""


def _read_secret_file(path: str) -> str:
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise SecretError(f"cannot read the job secret file {path} ({e.strerror}); make one with "
                          f"`mingpt-torchrun --new-secret {path}`") from None
    try:
        st = os.fstat(fd)  # before fdopen, which refuses a directory with a traceback of its own
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"the job secret file {path} is not a regular file (a directory, FIFO or device): "
                              f"make one with `{MAKE_ONE}` and name that file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SecretError(f"the job secret file {path} must be yours and readable by you only (it is mode "
                              f"{st.st_mode & 0o777:o}, owner uid {st.st_uid}): chmod 600 {path}")
        fh = os.fdopen(fd)
    except BaseException:
        os.close(fd)
        raise
    with fh:
        return fh.read().strip()


def _random_bytes(value: str) -> int:
    """How many bytes the secret carries as hex, or as base64 (standard or URL-safe, padded or not); 0 if neither."""
    if re.fullmatch(r"[0-9a-fA-F]+", value):
        return len(value) // 2
    if re.fullmatch(r"[A-Za-z0-9+/_-]+={0,2}", value):
        body = value.rstrip("=")
        try:
            return len(base64.urlsafe_b64decode(body.replace("+", "-").replace("/", "_") + "=" * (-len(body) % 4)))
        except (binascii.Error, ValueError):
            return 0
    return 0


def _low_entropy(value: str) -> str | None:
    """Why a well-formed secret is still guessable (a human's pattern, not random bytes); None if it is not.
    A random 32-hex-character secret has about 14 distinct characters, no period, about 6 characters
    that repeat or step by one from the one before (not 3/4 of them), and is no hash of a common word. No check can tell
    random bytes from the hash of a word someone chose: only a secret the tool made is random."""
    if len(set(value)) < 8:
        return f"uses only {len(set(value))} distinct characters"
    period = next((p for p in range(1, len(value) // 2 + 1) if value[p:] == value[:-p]), None)
    if period is not None:
        return f"repeats a pattern of {period} characters"
    steps = sum(abs(ord(a) - ord(b)) <= 1 for a, b in zip(value, value[1:]))
    if 4 * steps >= 3 * (len(value) - 1):  # 0123456789abcdeffedcba9876543210 (29); random hex: 24 of 31 once in 10**12
        return f"is mostly runs (in {steps} of its {len(value)} characters the one before repeats or steps by one)"
    for word in COMMON_WORDS:
        for data, said in ((word, repr(word)), (f"{word}\n", f"{word!r} and a newline")):
            for algorithm in ("md5", "sha1", "sha256", "sha512"):
                if hashlib.new(algorithm, data.encode()).hexdigest() == value.lower():
                    return f"is the {algorithm} of {said}"
    return None


def new_secret() -> str:
    """A fresh random secret (256 bits, hex) that the rules accept."""
    while (_low_entropy(value := secrets.token_hex(32))) is not None:  # (never seen: runs in 3/4 of it)
        pass
    return value


def write_new_secret(path: str) -> None:
    """`mingpt-torchrun --new-secret FILE`: a fresh secret in a new file, mode 0600, whole or not at all;
    an existing file is never replaced (the job's other nodes, or a requeue, may read it)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mingpt-secret-")  # 0600
    except OSError as e:
        raise SecretError(f"cannot write a job secret in {folder} ({e.strerror})") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(new_secret() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)  # refuses an existing name, a symlink included: never over another file
    except FileExistsError:
        raise SecretError(f"{path} exists: a job secret is never overwritten (a node or a requeue of the job may "
                          "use it); name a new file, or remove this one first") from None
    except OSError as e:
        raise SecretError(f"cannot write the job secret file {path} ({e.strerror})") from None
    finally:
        os.unlink(tmp)


def job_secret(env: dict[str, str] | None = None) -> bytes | None:
    """The job's secret from MINGPT_JOB_SECRET or the file MINGPT_JOB_SECRET_FILE names; None if neither is set.
    It must carry at least 128 bits, 32 hex characters or base64 of 16 bytes, with no visible pattern
    (_low_entropy): what can be checked; `mingpt-torchrun --new-secret FILE` makes a random one."""
    env = os.environ if env is None else env
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if not value and path:
        value = _read_secret_file(path)
    if not value:
        return None
    value = value.strip()
    where = f"the job secret ({SECRET_ENV} or {SECRET_FILE_ENV})"
    made = f"make one with `{MAKE_ONE}` and set {SECRET_FILE_ENV}=FILE"
    if len(value) < 32 and _random_bytes(value) < SECRET_BYTES:
        raise SecretError(f"{where} has {len(value)} characters: use at least 32 random hex ones; {made}")
    if _random_bytes(value) < SECRET_BYTES:
        raise SecretError(f"{where} is neither hex nor base64 of at least {SECRET_BYTES} bytes (128 bits): {made}")
    if (why := _low_entropy(value)) is not None:
        raise SecretError(f"{where} {why}: it must be random bytes, not chosen (what is checked: 128 bits or more, "
                          f"no repeats, runs or hash of a common word; a hash of any other word passes): {made}")
    return value.encode()


def derive(secret: bytes, purpose: str) -> str:
    """A value for one purpose (a store's key prefix, a signing key, the launch id) that reveals nothing of the secret."""
    return hmac.new(secret, purpose.encode(), hashlib.sha256).hexdigest()


def bound_store(host: str, port: int, is_master: bool, timeout: datetime.timedelta, **kwargs) -> dist.TCPStore:
    """A TCPStore that, where this process hosts it, listens on host's address only (TCPStore alone
    listens on every interface whatever host it is given: the socket is bound here and handed over)."""
    if not is_master:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, **kwargs)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(512)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, timeout=timeout, master_listen_fd=listener.detach(),
                         use_libuv=True, **kwargs)


class ForgedValueError(RuntimeError):
    """A value the job must trust was never found signed with the job's secret within the store's timeout."""


# What torch's elastic agents take on trust from the rendezvous store (torch 2.13): the workers' store
# address (RendezvousStoreInfo.build) and the agents' ranks (SimpleElasticAgent._assign_worker_ranks).
# The rendezvous state is signed by mingpt.cli.rendezvous.SignedBackend; the exit barrier's keys
# are counters (`add`) and markers whose value nobody reads.
TRUSTED = re.compile(r"(^|/)(MASTER_ADDR|MASTER_PORT|torchelastic/(role_info|assigned_ranks)/\d+)$")
_TAG = hashlib.sha256().digest_size
_POLL_S = 0.1


class SignedStore(dist.Store):
    """A store whose values under the `trusted` keys are signed (HMAC-SHA256 of the key and the value)
    on the way in and checked on the way out; every other operation goes through unchanged.

    A value that fails the check is ignored: the last good value of that key is kept if this store
    saw one (one WARNING names the key), otherwise the key is read again until a signed value comes
    or the timeout passes, then ForgedValueError says so in one line. torch's PrefixStore (and so
    the rendezvous handler's per-round prefix) works on top of it, as long as Python holds a
    reference to this object (the handler does): a PrefixStore around it does not keep it alive.
    """

    def __init__(self, inner: dist.Store, key: bytes, trusted: re.Pattern = TRUSTED):
        super().__init__()
        self._inner, self._key, self._trusted = inner, key, trusted
        self._good: dict[str, bytes] = {}
        self._warned: set[str] = set()
        # PrefixStore.set_timeout sets this object's timeout (C++), not the inner store's: kept in step below
        dist.Store.set_timeout(self, inner.timeout)

    # --- signing --------------------------------------------------------------------------------
    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        if self._trusted.search(key) is None:
            return value
        self._good[key] = value
        return self._tag(key, value) + value

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value of a signed key's raw bytes; None if they are not signed with this key."""
        tag, value = raw[:_TAG], raw[_TAG:]
        if len(raw) < _TAG or not hmac.compare_digest(tag, self._tag(key, value)):
            return None
        self._good[key] = value
        return value

    def _checked(self, key: str, raw: bytes) -> bytes:
        if self._trusted.search(key) is None:
            return raw
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (value := self._open(key, raw)) is None:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("the store's value of %s is not signed with this job's secret: a process outside the "
                            "job wrote it; it is ignored", key)
            if key in self._good:
                return self._good[key]
            if time.monotonic() > deadline:
                raise ForgedValueError(
                    f"the store's value of {key} was not signed with this job's secret for {self.timeout.total_seconds():g} s "
                    "(read_timeout): a process outside the job keeps overwriting it, or the nodes were given different "
                    "secrets. Run the job on a network only its hosts reach")
            time.sleep(_POLL_S)
            raw = self._raw_get(key)
        return value

    def _raw_get(self, key: str) -> bytes:
        self._inner.set_timeout(self.timeout)
        return self._inner.get(key)

    # --- the store ------------------------------------------------------------------------------
    def set(self, key, value):
        self._inner.set(key, self._seal(key, value))

    def get(self, key):
        return self._checked(key, self._raw_get(key))

    def multi_set(self, keys, values):
        self._inner.multi_set(keys, [self._seal(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys):
        self._inner.set_timeout(self.timeout)
        return [self._checked(k, raw) for k, raw in zip(keys, self._inner.multi_get(keys), strict=True)]

    def compare_set(self, key, expected, desired):
        if self._trusted.search(key) is not None:
            raise NotImplementedError(f"compare_set of a signed key ({key})")
        return self._inner.compare_set(key, expected, desired)

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def wait(self, keys, timeout=None):
        self._inner.wait(keys, self.timeout if timeout is None else timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def delete_key(self, key):
        self._good.pop(key, None)
        return self._inner.delete_key(key)

    deleteKey = delete_key  # the names torch's C++ side calls a Python store by

    def num_keys(self):
        return self._inner.num_keys()

    getNumKeys = num_keys

    def set_timeout(self, timeout):
        dist.Store.set_timeout(self, timeout)
        self._inner.set_timeout(timeout)
