"""The replica groups' membership alone, at hundreds of members: their beacons (mingpt.replicas.beacon,
no model, no training, no epoch process group), spread over a few processes on loopback, each member
on its own port with the job's one secret, each forming epochs in a thread of its own.

    python -m benchmarks membership-sim [--members 256 1024] [--per-process 128] [--lose 10] [--fan-out 6]
        [--heartbeat-s 0.1] [--lost-after-s 1.0] [--deadline-s 120] [--window-s 3] [--max-threads 4096] [--keep DIR]

The members hear each other through a tree of relays (replicas.fan_out: --fan-out members below each).

For each number of members N: the time from the start until every member holds an epoch of all N
(`first_formation_s`); each member's beacon traffic over --window-s then (`beacon_msgs_per_s`,
`beacon_bytes_per_s`: Links.sent), its channels (`Links.channels()`), the threads per process and per
member, the CPU all members used (`cpu_cores`; `cpu_ms_per_member_s`: a member's share, milliseconds a
second), and the epochs members took meanwhile (`epochs_taken_in_window`, every member's takes, and
`epochs_formed_in_window`, how many epochs those were: 0 when steady); then --lose
members (0, the coordinator, to lose - 1: their processes SIGKILLed at once) and the time from the kill
until every survivor holds an epoch without them (`reformation_s`, the aim being 2 s; `reformed_world`:
its members), and the survivors' channels once it has (`channels_after`: a member
whose parent and every ancestor were lost hangs from the members past the lost ones). Members' figures:
median, max and the member holding the max. A survivor leaves its epoch when `beacon.lost(epoch)` says
why (or another member waits to join: `beacon.joiners`) and forms again. The quorum is a majority, or
the survivors where they are fewer. A setting that does not form within --deadline-s (or whose process
passes --max-threads: a beacon's links to every other member cost threads) says so in its line, and the
next one runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

from benchmarks import die_with_bench, free_port_runs
from benchmarks.survivors import REPO
from benchmarks.survivors_scale import stat
from mingpt.replicas.beacon import Beacon
from mingpt.runtime.trust import job_secret

POLL_S = 0.05  # how often a member holding an epoch asks whether it must form again, at most
QUIET_S = 0.25  # ... and at least (what only time changes: a silent member)
TIMEOUT_S = 30.0  # replicas.timeout_s's default


class SimBeacon(Beacon):
    """A beacon whose epochs make no links: the membership is what is measured."""

    def own_store(self):
        return NO_STORE  # (no links, so no store for them to meet on: a thousand would each start a server)

    def _make_group(self, epoch, timeout_s: float) -> None:
        pass

    def watch(self, epoch, stop: threading.Event) -> str | None:
        """Until `epoch` cannot go on (why), or `stop`: asked on the beacon's news, POLL_S apart at most, and
        QUIET_S after the last (asked every POLL_S whatever came, a thousand members' threads in 26 processes
        woke 20,000 times a second, and took the beacons' CPU)."""
        while not stop.is_set():
            seen, asked = self._news_n, time.monotonic()
            if (lost := self.lost(epoch)) is not None:
                return lost.cause
            if self.joiners(epoch):
                return "a member joins"
            self._await_news(seen, QUIET_S)
            stop.wait(max(0.0, asked + POLL_S - time.monotonic()))
        return None


NO_STORE = types.SimpleNamespace(port=1)


def layout(members: int, lose: int, per_process: int) -> list[range]:
    """The members of each process: the `lose` first (to be SIGKILLed together) in the first processes:
    the coordinator in one of its own, its successor in another, the rest of them in a third; the two
    after them, the coordinator and successor once those are lost, in one of their own (as each member
    is a process of its own in a job: these hear every member, and must not share a process, and its
    handshakes, with a hundred others); the rest dealt out in turn, `per_process` at most each: so each
    process holds members of every level of the tree, as a job's nodes do (by number, one process held
    every relay of a level, and its one reactor passed up the heartbeats of hundreds of members)."""
    rest = members - lose - 2
    procs = -(-rest // per_process)
    lost = [r for r in (range(0, 1), range(1, min(2, lose)), range(2, lose)) if r]
    return [*lost, range(lose, lose + 2), *(range(lose + 2 + i, members, procs) for i in range(procs))]


def quorum(members: int, lose: int) -> int:
    """A majority, or the survivors of the loss where they are fewer (the loss must not stop the job)."""
    return min(members // 2 + 1, members - lose)


# --- a process of members ------------------------------------------------------------------------
def child(args) -> None:
    """Members args.first, args.first + args.stride, ... (args.count of them): their beacons, then, on "go" from stdin, each
    forming epochs in its thread (a JSON line per epoch it holds); "report": each member's channels and
    what it sent; "quit": close."""
    logging.basicConfig(format="%(asctime)s.%(msecs)03d %(message)s", datefmt="%H:%M:%S")  # (its log: --keep)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per channel
    said = threading.Lock()

    def say(**kw) -> None:
        with said:
            print(json.dumps(kw), flush=True)
    addresses = [f"127.0.0.1:{args.port + i}" for i in range(args.members)]
    secret = job_secret()
    beacons = []
    for m in range(args.first, args.first + args.count * args.stride, args.stride):
        try:
            beacons.append(SimBeacon(addresses, m, secret, args.heartbeat_s, args.lost_after_s,
                                     quorum_wait_s=args.deadline_s, fan_out=args.fan_out))
        except (RuntimeError, OSError) as e:  # (a thread or a descriptor refused)
            return say(event="error", why=f"member {m} could not start its beacon ({e})")
        if threading.active_count() > args.max_threads:
            return say(event="error", why=f"{threading.active_count()} threads in a process after {len(beacons)} of "
                                          f"its {args.count} beacons: over --max-threads {args.max_threads}")
    say(event="ready")
    stop = threading.Event()

    def member(beacon: Beacon) -> None:
        why = ""
        while not stop.is_set():
            epoch = beacon.form(0, False, args.quorum, TIMEOUT_S, stop.is_set, why)
            if epoch is None:
                return
            say(event="epoch", member=beacon.member, number=epoch.number, world=epoch.world,
                lowest=epoch.members[0].number, t=time.time(), why=why)
            why = beacon.watch(epoch, stop)
    for line in sys.stdin:
        if line.strip() == "go":
            for b in beacons:
                threading.Thread(target=member, args=(b,), daemon=True).start()
        elif line.strip() == "report":
            say(event="report", t=time.time(), members={b.member: [b.links.channels(), b.links.sent["messages"],
                                                                   b.links.sent["bytes"]] for b in beacons})
        else:
            break
    stop.set()
    for b in beacons:
        b.close()


# --- the bench -----------------------------------------------------------------------------------
def threads_of(pid: int) -> int:
    try:
        return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("Threads:")))
    except (OSError, StopIteration):
        return 0


def epochs_in(takes: list[tuple[float, int]], t1: float, t2: float) -> dict:
    """Of the members' takes of epochs, (when, its number) each, those in (t1, t2]: how many takes, and how
    many epochs they were (a new epoch of N members is N takes: 3,283 takes of 2,048 members, read as
    epochs, looked like thousands where the job formed one or two)."""
    taken = [number for t, number in takes if t1 < t <= t2]
    return {"epochs_taken_in_window": len(taken), "epochs_formed_in_window": len(set(taken))}


def cpu_s(pids) -> float:
    """CPU seconds (user and system) the processes `pids` have used so far."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


class Sim:
    """One setting's processes of members, and what they say (a reader thread each, into one queue)."""

    def __init__(self, args, members: int, logs: Path):
        self.args, self.members = args, members
        self.parts = layout(members, args.lose, args.per_process)
        port = free_port_runs(1, members)[0]
        env = {**os.environ, "MINGPT_JOB_SECRET": secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.membership_sim", "--child", "--first", str(r.start), "--count", str(len(r)),
             "--stride", str(r.step),
             "--members", str(members), "--port", str(port), "--quorum", str(quorum(members, args.lose)),
             "--deadline-s", str(args.deadline_s), "--max-threads", str(args.max_threads),
             "--heartbeat-s", str(args.heartbeat_s), "--lost-after-s", str(args.lost_after_s),
             "--fan-out", str(args.fan_out)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            stderr=open(logs / f"members{members}-process{i}.log", "w"), preexec_fn=die_with_bench)
            for i, r in enumerate(self.parts)]
        self.said: queue.Queue = queue.Queue()
        self.lost = sum(1 for r in self.parts if r.start < args.lose)  # the processes of the lost members
        self.killed = False  # those SIGKILLed: their end is expected
        self.epochs: list[tuple[float, int]] = []  # each member's take of each epoch: (when, its number)
        for i, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            with contextlib.suppress(ValueError):
                self.said.put((i, json.loads(line)))
        self.said.put((i, {"event": "exit"}))

    def tell(self, what: str, procs=None) -> None:
        for p in procs or self.procs:
            with contextlib.suppress(OSError):
                p.stdin.write(what + "\n")
                p.stdin.flush()

    def until(self, done, on_event, deadline: float, why: str) -> None:
        """Hand what the processes say to `on_event` until `done()`; RuntimeError(why...) past `deadline`,
        or where a process errs, exits or passes --max-threads."""
        while not done():
            if time.time() > deadline:
                raise RuntimeError(why)
            for i, p in enumerate(self.procs):
                if p.poll() is None and (n := threads_of(p.pid)) > self.args.max_threads:
                    raise RuntimeError(f"{why}: process {i} reached {n} threads, over --max-threads {self.args.max_threads}")
            with contextlib.suppress(queue.Empty):
                i, msg = self.said.get(timeout=0.1)
                if msg["event"] == "error":
                    raise RuntimeError(f"{why}: {msg['why']}")
                if msg["event"] == "exit" and (i >= self.lost or not self.killed):
                    raise RuntimeError(f"{why}: process {i} exited (code {self.procs[i].wait()})")
                if msg["event"] == "epoch":
                    self.epochs.append((msg["t"], msg["number"]))
                on_event(i, msg)

    def report(self, deadline: float) -> tuple[float, dict]:
        """Every member's (channels, messages, bytes) now, and when (the latest process's time)."""
        got: dict = {}
        times = []

        def take(_, msg):
            if msg["event"] == "report":
                got.update({int(m): v for m, v in msg["members"].items()})
                times.append(msg["t"])
        live = self.procs[self.lost:] if self.killed else self.procs
        self.tell("report", live)
        self.until(lambda: len(times) == len(live), take, deadline, "no report")
        return max(times), got

    def close(self) -> None:
        self.tell("quit")
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def setting(args, members: int, logs: Path) -> dict:
    sim = Sim(args, members, logs)
    lose = range(args.lose)
    out = {"members": members, "processes": [len(r) for r in sim.parts], "quorum": quorum(members, args.lose),
           "heartbeat_s": args.heartbeat_s, "lost_after_s": args.lost_after_s}
    try:
        ready = []
        deadline = time.time() + args.deadline_s
        try:
            sim.until(lambda: len(ready) == len(sim.procs), lambda i, m: ready.append(i) if m["event"] == "ready" else None,
                      deadline, f"did not start within {args.deadline_s:g} s")
        except RuntimeError as e:
            raise RuntimeError(f"{e} ({len(ready)} of {len(sim.procs)} processes had started their beacons)") from None
        whole: dict[int, float] = {}
        biggest = [0]

        def first(_, msg):
            if msg["event"] == "epoch":
                biggest[0] = max(biggest[0], msg["world"])
                if msg["world"] == members:
                    whole.setdefault(msg["member"], msg["t"])
        go = time.time()
        sim.tell("go")
        try:
            sim.until(lambda: len(whole) == members, first, go + args.deadline_s,
                      f"did not form within {args.deadline_s:g} s")
        except RuntimeError as e:
            raise RuntimeError(f"{e} ({len(whole)} of {members} members held an epoch of all; the largest "
                               f"epoch held {biggest[0]})") from None
        out["first_formation_s"] = round(max(whole.values()) - go, 3)
        t1, before = sim.report(time.time() + args.deadline_s)
        cpu = cpu_s(p.pid for p in sim.procs)
        time.sleep(args.window_s)
        t2, after = sim.report(time.time() + args.deadline_s)
        cpu = cpu_s(p.pid for p in sim.procs) - cpu
        threads = {i: threads_of(p.pid) for i, p in enumerate(sim.procs)}
        out.update(channels=stat({m: v[0] for m, v in after.items()}, 1),
                   beacon_msgs_per_s=stat({m: (after[m][1] - before[m][1]) / (t2 - t1) for m in after}, 1),
                   beacon_bytes_per_s=stat({m: (after[m][2] - before[m][2]) / (t2 - t1) for m in after}, 0),
                   threads_per_process=stat(threads, 0, "max_process"),
                   threads_per_member=round(sum(threads.values()) / members, 1),
                   cpu_cores=round(cpu / (t2 - t1), 2), cpu_ms_per_member_s=round(1000 * cpu / (t2 - t1) / members, 2),
                   **epochs_in(sim.epochs, t1, t2))
        again: dict[int, tuple[float, int]] = {}

        def without(_, msg):
            if msg["event"] == "epoch" and msg["t"] > kill and msg["lowest"] >= len(lose):
                again.setdefault(msg["member"], (msg["t"], msg["world"]))
        kill = time.time()
        for p in sim.procs[:sim.lost]:
            os.kill(p.pid, signal.SIGKILL)
        sim.killed = True
        survivors = members - len(lose)
        try:
            sim.until(lambda: len(again) == survivors, without, kill + args.deadline_s,
                      f"did not re-form within {args.deadline_s:g} s of losing members {lose.start}-{lose.stop - 1}")
        except RuntimeError as e:
            raise RuntimeError(f"{e} ({len(again)} of {survivors} survivors held an epoch without them)") from None
        out["reformation_s"] = round(max(t for t, _ in again.values()) - kill, 3)
        out["reformed_world"] = {"min": min(w for _, w in again.values()), "max": max(w for _, w in again.values())}
        time.sleep(args.window_s)  # (the members whose parents were lost hang from others now)
        _, now = sim.report(time.time() + args.deadline_s)
        out["channels_after"] = stat({m: v[0] for m, v in now.items()}, 1)
    except RuntimeError as e:
        out["error"] = str(e)
    finally:
        sim.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks membership-sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", type=int, default=[256, 1024], help="the numbers of members to run")
    ap.add_argument("--per-process", type=int, default=128, help="members per process at most (the lost ones aside)")
    ap.add_argument("--lose", type=int, default=10, help="members lost at once (the coordinator among them)")
    ap.add_argument("--deadline-s", type=float, default=120, help="starting, forming and re-forming each, at most")
    ap.add_argument("--window-s", type=float, default=3, help="the steady window the traffic is measured over")
    ap.add_argument("--max-threads", type=int, default=4096, help="threads per process at most: past it, the setting "
                                                                  "stops (this machine's other users go on)")
    ap.add_argument("--heartbeat-s", type=float, default=0.1, help="replicas.heartbeat_s (its default: 0.1)")
    ap.add_argument("--lost-after-s", type=float, default=1.0, help="replicas.lost_after_s (its default: 1.0)")
    ap.add_argument("--fan-out", type=int, default=6, help="replicas.fan_out: members below each relay of the tree")
    ap.add_argument("--keep", help="keep each process's log here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--first", "--count", "--stride", "--port", "--quorum"):
        ap.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.members = args.members[0]
        return child(args)
    if any(n < args.lose + 2 for n in args.members):
        ap.error(f"--members {args.members}: at least --lose {args.lose} + 2 (survivors to form an epoch without them)")
    if args.lose < 1:
        ap.error(f"--lose {args.lose}: 1 or more (the coordinator among them)")
    with tempfile.TemporaryDirectory(prefix="mingpt-membership-sim-") as scratch:
        logs = Path(args.keep or scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for members in args.members:
            print(json.dumps(setting(args, members, logs)), flush=True)


if __name__ == "__main__":
    main()
