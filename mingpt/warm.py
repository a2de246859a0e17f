"""Warm restarts: a node-local process that has imported everything forks each restarted worker.

A restarted worker spends most of its start-up importing (torch 1.1 s, torch._dynamo 1.0 s, which
DDP and the optimizers import on first use, Hydra) on this machine. Under torchrun the first worker
of a node starts a *warm server* beside it (`python -m mingpt.warm`, in its own session, at low
priority): it imports all of that once and waits on a node-local socket. A worker that torchrun
starts later finds the server, hands it its command line, environment, working directory and its
stdin/stdout/stderr, and the server forks a child that runs the training with them; the worker
stays as a thin proxy that passes torchrun's signals on and exits with the child's status. A
SIGKILLed proxy takes its child with it (the server kills it when the proxy's connection drops);
the server ends with its torchrun agent. Without a server (the first start, another OS, or
MINGPT_WARM=0), a worker runs cold, as before.

This module imports only the standard library: it runs before anything heavy is imported.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import zlib

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_HEADER = struct.Struct("!I")


def enabled() -> bool:
    return (sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ
            and os.environ.get("MINGPT_WARM", "1") != "0" and "MINGPT_WARM_CHILD" not in os.environ
            and "MINGPT_WARM_SERVER" not in os.environ)


def forked() -> bool:
    """Whether this process is a warm server's child (a restart that skipped the imports)."""
    return "MINGPT_WARM_CHILD" in os.environ


def address(agent_pid: int) -> str:
    """The server's abstract socket (per user, torchrun agent, interpreter and network namespace)."""
    return f"\0mingpt-warm-{os.getuid()}-{agent_pid}-{zlib.crc32(sys.executable.encode()):08x}"


def _send(sock: socket.socket, obj, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket, with_fds: int = 0):
    """One message (and the file descriptors sent with it), or None at EOF."""
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, with_fds)
    else:
        head, fds = sock.recv(_HEADER.size, socket.MSG_WAITALL), []
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return (json.loads(body), fds) if with_fds else json.loads(body)


def handoff() -> None:
    """In a worker: run in a warm server's child if one serves this node, and exit with its status;
    else start a server for the next restart (local rank 0 only) and return to run cold."""
    if not enabled():
        return
    from mingpt.training.ledger import process_start_epoch

    agent = os.getppid()
    die_with(agent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address(agent))
    except OSError:
        sock.close()
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _start_server(agent)
        return
    env = {**os.environ, "MINGPT_PROCESS_START": repr(process_start_epoch()), "MINGPT_WARM_CHILD": str(os.getpid())}
    try:
        _send(sock, {"argv": sys.argv, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
        reply = _recv(sock)
    except OSError:
        reply = None
    if reply is None:  # the server is going away: run cold
        sock.close()
        return
    child = reply["pid"]
    for s in FORWARDED:
        signal.signal(s, lambda signum, frame: _forward(child, signum))
    while True:
        try:
            status = _recv(sock)
            break
        except InterruptedError:
            continue
    sys.stdout.flush()
    if status is None:  # the server died: so did the child (it dies with the server)
        os._exit(1)
    code = status["status"]
    if code < 0:  # killed by a signal: end the same way, so torchrun reports the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def die_with(parent: int) -> None:
    """Make the kernel SIGKILL this process when its parent (the torchrun agent) dies (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


def _start_server(agent: int) -> None:
    """Start the server in its own session (torchrun's kills of the workers do not reach it)."""
    subprocess.Popen([sys.executable, "-m", "mingpt.warm", str(agent)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                     env={**os.environ, "MINGPT_WARM_SERVER": "1"})


def warm_up() -> bool:
    """Import what a worker imports, and what its first steps import lazily, without touching a GPU
    (CUDA does not survive a fork). False where a forked child could not use the GPUs."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without initialising CUDA
    import torch

    torch.set_num_threads(1)
    import torch._dynamo  # noqa: F401 - DDP and the optimizers import it at first use
    import mingpt.main  # noqa: F401 - everything the entry point imports
    from mingpt.compose import compose
    from mingpt.model import GPT, GPTConfig
    from mingpt.training.optim import build_optimizer

    compose([])  # Hydra's first composition loads its plugins
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=16, block_size=8))
    optimizer = build_optimizer(model, 1e-3, (0.9, 0.95), 0.1)
    x = torch.zeros(1, 8, dtype=torch.long)
    model(x, x)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return not torch.cuda.is_initialized() and _forked_child_sees_gpus()


def _forked_child_sees_gpus() -> bool:
    """On a GPU node, a forked child must be able to start CUDA: try it once (one small tensor)."""
    import torch

    if not torch.cuda.is_available():
        return True
    pid = os.fork()
    if pid == 0:
        try:
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure means: do not serve
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def serve(agent: int) -> None:
    """The server: fork one child per request until the agent is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(agent))
    except OSError:
        return  # another server serves this agent
    listener.listen(64)  # requests wait here while the server warms up
    if not warm_up():  # keep the address, and send every worker back to run cold
        while _agent_alive(agent):
            if select.select([listener], [], [], 1.0)[0]:
                listener.accept()[0].close()
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}  # child pid -> its proxy's connection
    while True:
        conns = {c.fileno(): (pid, c) for pid, c in children.items()}
        ready, _, _ = select.select([listener, wake_r, *[c for _, c in conns.values()]], [], [], 1.0)
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                pid = _fork_child(conn, listener, children)
                if pid:
                    children[pid] = conn
            elif r is wake_r:
                os.read(wake_r, 512)
            else:  # a proxy's connection closed (or sent something): its child goes
                pid, conn = conns[r.fileno()]
                _forward(pid, signal.SIGKILL)
        _reap(children)
        if not _agent_alive(agent):
            for pid in children:
                _forward(pid, signal.SIGKILL)
            return


def _agent_alive(agent: int) -> bool:
    try:
        os.kill(agent, 0)
        return True
    except ProcessLookupError:
        return False


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                _send(conn, {"status": code})
            except OSError:
                pass
            conn.close()


def _fork_child(conn: socket.socket, listener: socket.socket, children: dict) -> int:
    """Fork a worker for one request; returns its pid (0 when the request was unreadable)."""
    try:
        msg, fds = _recv(conn, with_fds=3)
    except (OSError, TypeError, ValueError):
        conn.close()
        return 0
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            _forward(pid, signal.SIGKILL)
        return pid
    # the child: the worker's streams, environment, directory and command line, then the entry point
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, *FORWARDED):
            signal.signal(s, signal.SIG_DFL)
        listener.close()
        conn.close()
        for c in children.values():
            c.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        sys.argv = msg["argv"]
        import mingpt.main

        mingpt.main.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it on the worker's stderr, as a cold worker would
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
