"""torchrun as a user wants it: `mingpt-torchrun` takes exactly torchrun's arguments.

    mingpt-torchrun --standalone --nproc_per_node=2 mingpt/main.py ...
    mingpt-torchrun --nnodes=1:2 --nproc_per_node=gpu --rdzv_endpoint=HOST1:29500 --rdzv_id=run1 ... mingpt/main.py ...

What it changes:
- the rendezvous is `--rdzv_backend=mingpt` (signed state, secret keys, bound to its address: see
  mingpt/cli/rendezvous.py) unless another backend is named; `--standalone` becomes that backend on
  127.0.0.1 with a secret made for this launch;
- the job's exit code is the workers' (2 a bad setting, 74 a failed save, 75 stopped and saved on
  SIGTERM or Ctrl-C, 77 another launch took the store's lease over, 130 stopped at once without
  saving), and what the user sees of a failure is the workers' one line: no agent traceback, no
  table of failures;
- a worker that exits 2, 74 or 77 is not restarted: a bad setting, a store that refuses the save
  or a store that another launch took over does not go away by trying again (torchrun would retry
  it --max-restarts times);
- each worker is told its agent's pid (MINGPT_AGENT_PID), so that one whose agent died while it
  started exits at once (mingpt/runtime/orphan.py);
- a rendezvous that cannot form is one line saying what to check, and so is a value in its store
  that was forged (mingpt.runtime.trust.SignedStore) or never came; the agent's C++ warnings (with
  their stack frames) are not printed;
- the settings are checked here, before any worker starts (a typo is one line, exit 2, in a second);
- a Ctrl-C while the workers start ends the job at once: one line, exit 130.

`mingpt-torchrun --new-secret FILE` writes a new random job secret to FILE (mode 0600) and does nothing else.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import uuid

# c10d's C++ warnings and errors in this process (a rendezvous store that went away: three of them, each
# a line and some 30 `frame #N` lines; one that cannot be reached: one) say what our one line then says.
# torch reads the level once, as it loads: set for the agent only, then unset, so the workers keep theirs.
if _QUIET_CPP := "TORCH_CPP_LOG_LEVEL" not in os.environ:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
import torch  # noqa: F401 - loaded here, under that level

if _QUIET_CPP:
    del os.environ["TORCH_CPP_LOG_LEVEL"]

from mingpt.runtime.exits import RESTART_SIGNAL, Exit
from mingpt.runtime.orphan import AGENT_ENV
from mingpt.runtime.trust import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    ForgedValueError,
    SecretError,
    job_secret,
    write_new_secret,
)

# A worker's exit codes that no restart can change (see the README's exit codes).
PERMANENT = {Exit.BAD_INPUT, Exit.SAVE_FAILED, Exit.LEASE_LOST}


def _option(argv: list[str], name: str, default: str) -> str:
    """The value of a torchrun option, written --rdzv_x=V, --rdzv-x=V or --rdzv_x V."""
    names = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in names:
            return value or (argv[i + 1] if i + 1 < len(argv) else default)
    return default


def _conf(argv: list[str], key: str, default: str) -> str:
    for item in _option(argv, "rdzv_conf", "").split(","):
        k, _, v = item.partition("=")
        if k.strip() == key:
            return v.strip()
    return default


def with_our_rendezvous(args, argv: list[str], env) -> None:
    """torchrun's parsed arguments, changed to the mingpt rendezvous where the command line names no
    other backend (`--standalone`, or no endpoint: on 127.0.0.1, with a secret made for this launch)."""
    named = _option(argv, "rdzv_backend", "")
    if args.standalone or not (named or args.rdzv_endpoint):
        args.standalone = False
        args.rdzv_endpoint, args.rdzv_id = "127.0.0.1:0", str(uuid.uuid4())
        if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):
            env[SECRET_ENV] = secrets.token_hex(32)
    elif named:
        return
    args.rdzv_backend = "mingpt"


def _agent_class():
    """torchrun's agent, told which worker failures are permanent and keeping the workers' exit codes."""
    from torch.distributed.elastic.agent.server import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        exit_codes: list[int] = []
        _last, _restarting = None, False

        def _monitor_workers(self, worker_group):
            result = self._last = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and self._remaining_restarts > 0:
                codes = {f.exitcode for f in result.failures.values()}
                if codes & PERMANENT:
                    self._remaining_restarts = 0  # torchrun then stops the workers and ends the job
            return result

        def _restart_workers(self, worker_group) -> None:
            # torchrun's own restart lines are quieted (see main): one line of ours, where it happens
            state = getattr(getattr(self._rdzv_handler, "_state_holder", None), "state", None)  # torch's dynamic one
            print(f"mingpt-torchrun: {restart_reason(self._last, state)}: restarting the workers on "
                  f"{socket.gethostname()} ({self._remaining_restarts} restarts left)", file=sys.stderr, flush=True)
            self._restarting = True
            try:
                super()._restart_workers(worker_group)
            finally:
                self._restarting = False

        def _shutdown(self, death_sig=signal.SIGTERM, timeout: int = 30) -> None:
            if self._restarting:  # the workers save and stop as for SIGTERM, and say it is a restart
                death_sig = RESTART_SIGNAL
            context = self._pcontext
            super()._shutdown(death_sig, timeout)
            handlers = getattr(context, "subprocess_handlers", {}) if context is not None else {}
            Agent.exit_codes = [h.proc.returncode for h in handlers.values() if h.proc.returncode is not None]

    return Agent


def restart_reason(result, state=None) -> str:
    """Why the agent restarts its workers, from its last look at them: a worker that failed, or
    (the workers healthy) nodes waiting for a new rendezvous round. The agent has signalled nobody yet,
    so a worker killed by a signal is the cause and a peer that exited within the same look is its loss
    of that worker (torchrun's clock for failures counts whole seconds: the earliest second does not tell
    them apart). `state`: the rendezvous's (torch's _RendezvousState, just synced by num_nodes_waiting);
    a node waiting that is a participant of this round is an agent of the job restarting its workers
    (an agent keeps its name, host_pid_id, for its life), any other is a node joining."""
    failures = list(getattr(result, "failures", {}).values()) if result is not None else []
    if not failures:
        if state is None:  # another rendezvous: all it says is that a node waits
            return "a node asked for a new rendezvous round (one joined, or a node's workers restarted)"
        waiting = sorted(state.wait_list, key=repr)
        again = [n for n in waiting if n in state.participants]
        joined = [n for n in waiting if n not in state.participants]
        said = [f"the workers on {n.addr} (agent pid {n.pid}) restarted" for n in again]
        said += [f"a node joined the job ({n.addr}, agent pid {n.pid})" for n in joined]
        return "; ".join(said) or "a node asked for a new rendezvous round"
    first = min([f for f in failures if f.exitcode < 0] or failures, key=lambda f: f.timestamp)
    how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    return f"worker {first.local_rank} {how}"


def exit_code_of_signal(signum: int, worker_codes: list[int]) -> int:
    """The job's code when the agent was signalled (Ctrl-C, SIGTERM): what the workers said after their
    save, or the shell's 128 + signal when they said nothing."""
    said = [c for c in worker_codes if c > 0]
    if Exit.SAVE_FAILED in said:
        return Exit.SAVE_FAILED
    return max(said) if said else 128 + signum


def exit_code_of_failures(failures: list) -> int:
    """The launcher's exit code when the workers failed for good: the code of the first worker that
    exited by itself (it said why). Workers killed by a signal are the agent stopping the others
    after that one (torchrun's "first failure" may be one of them: its clock counts whole seconds),
    unless no worker exited by itself; then one line says which and the code is the shell's."""
    exited = [f for f in failures if f.exitcode > 0]
    exited = [f for f in exited if f.exitcode in PERMANENT] or exited  # why the job ended, not a peer's loss of it
    if exited:
        return min(exited, key=lambda f: f.timestamp).exitcode
    first = min(failures, key=lambda f: f.timestamp)
    print(f"mingpt-torchrun: worker {first.local_rank} on {socket.gethostname()} was killed by "
          f"{signal.Signals(-first.exitcode).name}; no restarts left (--max-restarts)", file=sys.stderr)
    return 128 - first.exitcode


def check_settings(args) -> None:
    """The workers' settings, composed and validated here before any worker starts (a mistyped key
    cost every worker its imports first), where the script is this package's main.py; a ConfigError
    says what the first worker would. Hydra's own flags (--cfg job) are left to the workers."""
    from mingpt.config.compose import compose, dashed_settings

    main = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "main.py")
    ours = args.training_script == "mingpt.main" if args.module else (
        not args.no_python and os.path.realpath(args.training_script) == os.path.realpath(main))
    overrides = list(args.training_script_args)
    if ours and not (any(a.startswith("-") for a in overrides) and not dashed_settings(overrides)):
        dashed_settings(overrides, refuse=True)
        compose(overrides)


def _set_up(argv: list[str], torchrun, launcher):
    """torchrun's arguments with our rendezvous, the workers' parent named for them, and our agent."""
    args = torchrun.parse_args(argv)
    with_our_rendezvous(args, argv, os.environ)
    os.environ[AGENT_ENV] = f"{os.getpid()}:{args.rdzv_id}"  # the workers' parent, checked as they start
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    launcher.LocalElasticAgent = _agent_class()
    # torchrun's own lines (the thread-count banner, the agent's progress, its tables of failures) repeat
    # what the workers say in one line; its restarts stay visible as the workers' start lines. Its
    # modules set their loggers' levels themselves, so each one is quieted here, once all are imported.
    for name in [*logging.root.manager.loggerDict, "torch.distributed"]:
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return args


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousStateError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher import api as launcher

    from mingpt.config.schema import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0].partition("=")[0] == "--new-secret":
        sys.exit(make_secret(argv))
    args = _set_up(argv, torchrun, launcher)
    endpoint = args.rdzv_endpoint
    try:
        check_settings(args)
        if args.rdzv_backend == "mingpt":
            job_secret()  # a missing or unsafe secret: one line here, before any rendezvous
        torchrun.run(args)
    except (SecretError, ConfigError) as e:
        sys.exit(_say(str(e), Exit.BAD_INPUT))
    except KeyboardInterrupt:  # before the workers started (torchrun's handler comes with them; see orphan.py)
        sys.exit(_say("Ctrl-C while starting: stopped before training, nothing to save", Exit.INTERRUPTED))
    except (ForgedValueError, RendezvousStateError) as e:  # a value or state in the store that the job did not write
        sys.exit(_say(str(e).strip().splitlines()[0], Exit.FAILED))
    except DistStoreError as e:  # a value the agents exchange never came: another node stopped in the rendezvous
        missing = str(e).strip().splitlines()[0].rsplit("/", 1)[-1][:80]
        sys.exit(_say(f"a value the nodes exchange through the rendezvous store at {endpoint} did not come within "
                      f"read_timeout={_conf(argv, 'read_timeout', '60')} s (the key {missing}): another node stopped during "
                      "the rendezvous (its output says why), or cannot reach the store", Exit.FAILED))
    except DistNetworkError:  # the node hosting the rendezvous store went away during the rendezvous
        sys.exit(_say(f"lost the rendezvous store at {endpoint} during the rendezvous: the node that hosts it "
                      "stopped (its output says why) or the network between them failed", Exit.FAILED))
    except ChildFailedError as e:
        sys.exit(exit_code_of_failures(list(e.failures.values())))
    except SignalException as e:
        sys.exit(exit_code_of_signal(int(e.sigval), launcher.LocalElasticAgent.exit_codes))
    except RendezvousConnectionError as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        sys.exit(_say(f"cannot reach the rendezvous store at {endpoint} within read_timeout="
                      f"{_conf(argv, 'read_timeout', '60')} s ({cause}). Check that the node it runs on is up and started "
                      "first (or mingpt-rendezvous runs there), that its name resolves from this node, and that the port "
                      "is open in the firewalls between them", Exit.FAILED))
    except RendezvousTimeoutError:
        sys.exit(_say(f"the nodes did not all join the rendezvous at {endpoint} within join_timeout="
                      f"{_conf(argv, 'join_timeout', '600')} s (--nnodes={_option(argv, 'nnodes', '?')}). Check that "
                      "every node was started with the same --rdzv_endpoint, --rdzv_id and job secret", Exit.FAILED))


def make_secret(argv: list[str]) -> int:
    """`mingpt-torchrun --new-secret FILE`: a new random job secret in FILE (mode 0600; never over a file)."""
    path = argv[0].partition("=")[2] or (argv[1] if len(argv) == 2 else "")
    if not path or len(argv) > (1 if "=" in argv[0] else 2):
        return _say("--new-secret takes one file name and nothing else: mingpt-torchrun --new-secret FILE", Exit.BAD_INPUT)
    try:
        write_new_secret(path)
    except SecretError as e:
        return _say(str(e), Exit.BAD_INPUT)
    print(f"mingpt-torchrun: a new job secret in {path} (mode 0600): give every node of the job "
          f"{SECRET_FILE_ENV}={path} (the same secret)", file=sys.stderr)
    return 0


def _say(message: str, code: int) -> int:
    print(f"mingpt-torchrun: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    main()
