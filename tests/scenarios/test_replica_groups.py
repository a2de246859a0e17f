"""Replica groups (mingpt.replicas): three groups, each its own torchrun. A group's worker is SIGKILLed
(its torchrun restarts it and it heals from a live peer) or frozen with SIGSTOP (silent, as a lost
node or a cut network: only the heartbeats tell). The other groups go on from the step in flight,
with no snapshot read; every global step is trained on exactly its samples; and the run ends with
the weights of the run without faults, bit for bit."""

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port_runs, make_corpus, records, torchrun_cmd, torchrun_env

from mingpt.replicas.standby import lock_path
from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

pytestmark = pytest.mark.slow

GROUPS = 3
STEPS = 200  # a killed group's restart (a new interpreter, about 5 s here) ends well before the last step
SECRET = secrets.token_hex(32)  # random per run: a chosen string is refused (mingpt.runtime.trust.job_secret)
CFG = ["model=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.block_size=64",
       "model.dropout=0.1", "trainer.batch_size=12", "trainer.micro_batch_size=2", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.progress=false", "trainer.threads=1", f"trainer.max_steps={STEPS}",
       "snapshot.every_steps=50"]


def launch(g: int, peers: list[str], corpus: Path, run_dir: Path, log: Path, procs: int = 1,
           extra: tuple = (), node=None) -> subprocess.Popen:
    """Group g: its own torchrun (of `procs` processes; restarted by its agent when one dies), on
    loopback or inside `node`'s network namespace (benchmarks/netns.py)."""
    cmd = torchrun_cmd(procs, "mingpt/main.py", *CFG, f"data.path={corpus}", f"data.cache_dir={run_dir.parent / 'cache'}",
                       f"trainer.run_dir={run_dir}", f"replicas.peers=[{','.join(peers)}]", f"replicas.group={g}",
                       *extra, max_restarts=2)
    env = torchrun_env(MINGPT_JOB_SECRET=SECRET, **({"GLOO_SOCKET_IFNAME": node.veth} if node else {}))
    return subprocess.Popen([*(node.prefix() if node else []), *cmd], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def run_job(tmp: Path, corpus: Path, fault=None, procs: int = 1, extra: tuple = (),
            nodes=None, spares: tuple = (), spares_later: bool = False) -> tuple[Path, list[Path], object]:
    """Three groups to the end (on loopback, or each on a node of `nodes`), and the command of each
    group in `spares` started a second time (agent and log appended), with the others or, `spares_later`,
    once the groups train (its processes then stand by, each for the member its first command holds);
    `fault(run_dir, agents)` runs meanwhile and returns what it saw."""
    run_dir = tmp / "run"
    tmp.mkdir(exist_ok=True)
    peers = ([f"{n.addr}:29611" for n in nodes] if nodes
             else [f"127.0.0.1:{port}" for port in free_port_runs(GROUPS, procs)])
    logs = [tmp / f"group{g}.log" for g in range(GROUPS)] + [tmp / f"group{g}-second.log" for g in spares]

    def start(i: int, g: int) -> subprocess.Popen:
        return launch(g, peers, corpus, run_dir, logs[i], procs, extra, nodes[g] if nodes else None)

    agents = [start(i, g) for i, g in enumerate([*range(GROUPS), *(() if spares_later else spares)])]
    seen = None
    try:
        if spares_later:
            wait_for_step(run_dir, 1, agents)
            agents += [start(GROUPS + i, g) for i, g in enumerate(spares)]
        seen = fault(run_dir, agents) if fault else None
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert codes == [0] * len(agents), "\n".join(log.read_text()[-3000:] for log in logs)
    return run_dir, logs, seen


def worker_of(agent: subprocess.Popen) -> int:
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def wait_for_step(run_dir: Path, step: int, agents, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert all(a.poll() is None for a in agents), "a group ended before the fault"
        steps = [r["step"] for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
        if steps and max(steps) >= step:
            return max(steps)
        time.sleep(0.01)
    raise AssertionError(f"step {step} not reached")


def final(run_dir: Path, steps: int = STEPS) -> dict:
    state, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    assert manifest["step"] == steps
    return state["model"]


def differing(weights: dict, expected: dict) -> dict[str, float]:
    """The tensors that are not bit for bit the expected ones, with their largest difference."""
    return {k: (weights[k].double() - expected[k].double()).abs().max().item() for k in expected
            if k not in weights or not torch.equal(weights[k], expected[k])}


def shares_by_step(run_dir: Path) -> dict[int, list]:
    """What each committed step was trained on: (samples, sum of sample ids) of every share; the last
    record of a step wins (the lineage the final weights come from)."""
    out = {}
    for r in records(run_dir / "metrics.jsonl"):
        if r.get("kind") == "train":
            out[r["step"]] = [share[1:] for share in r["shares"]]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas-ref")
    corpus = make_corpus(tmp)
    run_dir, _, _ = run_job(tmp, corpus)
    epochs = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"]
    return {"corpus": corpus, "weights": final(run_dir), "shares": shares_by_step(run_dir), "epochs": epochs,
            "run_dir": run_dir}


def kill_group_0(run_dir: Path, agents) -> int:
    """Group 0 is the first coordinator, and the member that logs and saves: nothing may hang on it."""
    step = wait_for_step(run_dir, 15, agents)
    os.kill(worker_of(agents[0]), signal.SIGKILL)
    return step, time.time()


def freeze_group_2(run_dir: Path, agents) -> int:
    step = wait_for_step(run_dir, 15, agents)
    worker = worker_of(agents[2])
    os.kill(worker, signal.SIGSTOP)  # silent: its connections stay open, only its heartbeats stop
    t = time.time()
    try:
        wait_for_step(run_dir, step + 30, agents)  # the others train on without it (not held by its old collective)
    finally:
        os.kill(worker, signal.SIGCONT)
    return step, t


def cut_group_2(bridge):
    """Once the groups train: group 2's link cut (its node's port on the bridge down) while the others
    train 30 steps, then mended."""
    def fault(run_dir: Path, agents) -> tuple[int, float]:
        step = wait_for_step(run_dir, 15, agents)
        node = bridge.nodes[2]
        bridge.cut(node)
        t = time.time()
        try:
            wait_for_step(run_dir, step + 30, agents)  # the others train on without it
        finally:
            bridge.mend(node)
        return step, t
    return fault


@pytest.fixture
def bridge():
    """A node per group: network namespaces with addresses of their own, on one bridge (root only)."""
    from benchmarks.netns import NoNamespaces, bridged_nodes

    try:
        with bridged_nodes(GROUPS, subnet=233) as nodes:
            yield nodes
    except NoNamespaces as e:
        pytest.skip(str(e))


def replica_lines(logs: list[Path]) -> str:
    """What each group's log says of its epochs, losses and waits (a failed check's context: a run that
    fails one time in thirty keeps nothing else)."""
    return "\n".join(f"{log.name}: {line}" for log in logs for line in log.read_text().splitlines()
                     if "mingpt.replicas" in line or "replica_trainer" in line)


def check_survived(reference, run_dir: Path, logs: list[Path], lost: int, fault: tuple[int, float],
                   spare: bool = False) -> list[dict]:
    """The survivors' epoch after the fault lacks the lost group and starts at the step in flight (no
    snapshot read, at most that step lost); the lost group comes back, healed from a peer. With a
    `spare`, the lost group's spare may be back before the survivors formed without it: then it is in
    their first epoch after the fault, healed from a peer, and no step is trained without it."""
    recs = records(run_dir / "metrics.jsonl")
    epochs = [r for r in recs if r.get("kind") == "epoch"]
    fault_step, fault_t = fault
    after = [e for e in epochs if e["time"] >= fault_t]
    without = [e for e in after if lost not in e["members"]][:1]
    if spare and after and lost in after[0]["members"]:  # (back before the survivors formed without it)
        without = []
    assert without or (spare and lost in after[0]["healed"]), (epochs, replica_lines(logs))
    first = without[0] if without else after[0]
    trained_before = max(r["step"] for r in recs if r.get("kind") == "train" and r["time"] <= first["time"])
    assert fault_step <= first["step"] == trained_before, (first, trained_before)
    back = [e for e in after if (e["time"] > first["time"] or not without) and lost in e["members"] and lost in e["healed"]]
    assert back and back[0]["healed_from"] != lost, (epochs, replica_lines(logs))
    # (a process started after the run's end reads its last snapshot, and trains nothing)
    assert not [r for r in recs if r.get("kind") == "resume" and r["step"] < STEPS], "a snapshot was read"
    if without and not without[0]["healed"]:  # no survivor had completed the step in flight: each trained it
        # again, computing only what it had not done before it noticed the fault
        for g in without[0]["members"]:  # (groups of one process: a member is its group)
            assert "shares done before the fault kept" in logs[g].read_text(), logs[g].read_text()[-3000:]
    # while it was away, the lost group's shares were split: one to each survivor, none idle
    away = [r for r in recs if r.get("kind") == "train" and lost not in r["members"]]
    assert away or spare, "no step was trained without the lost group"  # (a spare may be back before the next)
    assert without or not away, (len(away), first)  # (a spare in the survivors' first epoch: none without it)
    for r in away:
        per = len(r["shares"]) // GROUPS
        assert per == GROUPS - 1, r["shares"]
        assert sorted(share[0] for share in r["shares"][lost * per:(lost + 1) * per]) == sorted(r["members"]), r
    assert len({r["run_id"] for r in recs if r.get("kind") == "start"}) == 1  # one run, whichever group started it
    # exactly the fault-free run's samples in every global step, and the same weights, bit for bit
    assert shares_by_step(run_dir) == reference["shares"]
    weights = final(run_dir)
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)
    return epochs


def test_a_killed_group_costs_a_step_and_heals_from_a_peer(reference, tmp_path):
    run_dir, logs, fault = run_job(tmp_path, reference["corpus"], kill_group_0)
    check_survived(reference, run_dir, logs, lost=0, fault=fault)
    killed = logs[0].read_text()
    healed = re.findall(r"healed from replica group [12]: at step (\d+)", killed)  # (also at the start, if late)
    starts = re.findall(rf"training from step (\d+) to {STEPS}", killed)
    # its second start says the step it trains from: the one it was healed to, not 0
    assert healed and len(starts) == 2 and starts[-1] == healed[-1], killed[-3000:]
    for survivor in (logs[1].read_text(), logs[2].read_text()):  # which group, how, when; and its return
        assert re.search(r"replica epoch \d+ ended at step \d+: .*group 0 lost \(its connection closed\)", survivor), \
            survivor[-3000:]
        assert re.search(rf"replica group 0 joined at step {healed[-1]}, healed from group [12]", survivor), \
            survivor[-3000:]
    for log in logs:  # every group's console says the run ended, not only the leader's
        assert f"finished: step {STEPS}" in log.read_text(), log.read_text()[-3000:]


def test_through_a_tree_of_relays_a_killed_root_costs_a_step_and_heals_from_a_peer(reference, tmp_path):
    """replicas.fan_out=1: the three groups hear each other through a chain (group 2's beacon hangs from
    group 1's, which hangs from group 0's, the root: link.py), as a job of more than fan_out + 1 groups
    does. Group 0 SIGKILLed: group 1 finds it down, becomes the root, and tells group 2, which asks it
    for the next epoch through the tree; group 0 comes back below nobody (it is the root again) and
    heals; the run ends bitwise equal to the reference run without relays."""
    run_dir, logs, fault = run_job(tmp_path, reference["corpus"], kill_group_0, extra=("replicas.fan_out=1",))
    check_survived(reference, run_dir, logs, lost=0, fault=fault)
    assert re.search(r"replica epoch \d+ ended at step \d+: .*group 0 lost", logs[2].read_text()), logs[2].read_text()[-3000:]


def test_a_silent_group_is_left_behind_and_rejoins(reference, tmp_path):
    run_dir, logs, fault = run_job(tmp_path, reference["corpus"], freeze_group_2)
    epochs = check_survived(reference, run_dir, logs, lost=2, fault=fault)
    assert "group 2 lost" in [e for e in epochs if 2 not in e["members"] and e["time"] >= fault[1]][0]["why"]


def test_a_group_cut_off_by_the_network_trains_nothing_alone_and_rejoins_without_a_restart(reference, tmp_path, bridge):
    """A partition: each group on a node of its own, group 2's link cut for 30 steps of the others.
    They go on without it once its heartbeats stop; alone (1 of 3 groups: no quorum) it trains
    nothing; with the link back it rejoins and heals from a live group, the same process (no restart,
    no snapshot read). Every step's samples and the final weights are the run's without the cut."""
    run_dir, logs, fault = run_job(tmp_path, reference["corpus"], cut_group_2(bridge), nodes=bridge.nodes)
    epochs = check_survived(reference, run_dir, logs, lost=2, fault=fault)
    assert "group 2 lost" in [e for e in epochs if 2 not in e["members"] and e["time"] >= fault[1]][0]["why"]
    recs = records(run_dir / "metrics.jsonl")
    assert all(len(r["members"]) >= 2 for r in recs if r.get("kind") in ("train", "epoch")), "a lone group trained"
    cut_off = logs[2].read_text()
    assert cut_off.count("training from step") == 1, cut_off[-3000:]  # one process start: it was never restarted
    # in its own view too: every epoch it formed or joined held a quorum (2 of 3 groups)
    joined = [m.group(1).split(", ") for m in re.finditer(r"replica epoch \d+: groups \[([\d, ]+)\]", cut_off)]
    assert len(joined) >= 2 and all(len(groups) >= 2 for groups in joined), cut_off[-3000:]


STANDS_BY = "this process stands by as its spare"


def kill_group_1_beside_its_spare(run_dir: Path, agents) -> tuple[int, float]:
    """Group 1's command runs twice (agents 1 and 3): once the groups train and one of the two stands
    by, SIGKILL the other's process, the member."""
    logs = [run_dir.parent / "group1.log", run_dir.parent / "group1-second.log"]
    step = wait_for_step(run_dir, 15, agents)
    deadline = time.time() + 60
    while not any(STANDS_BY in log.read_text() for log in logs):
        assert time.time() < deadline, logs[1].read_text()[-3000:]
        time.sleep(0.05)
    member = agents[3] if STANDS_BY in logs[0].read_text() else agents[1]
    os.kill(worker_of(member), signal.SIGKILL)
    return step, time.time()


def test_a_spare_takes_a_killed_members_place_and_the_restarted_process_stands_by(reference, tmp_path):
    """Group 1's command started twice on its node: the second process builds everything, finds the
    member taken and stands by. Group 1's process is SIGKILLed: the spare takes its place at once (no
    interpreter, imports or build on the way), heals from a live group and trains; the killed process's
    torchrun restarts it, and it stands by in turn (at the end it takes the place, finds the run done
    and ends). The run ends bitwise equal to the one without the fault; every torchrun exits 0."""
    run_dir, logs, fault = run_job(tmp_path, reference["corpus"], kill_group_1_beside_its_spare, spares=(1,))
    check_survived(reference, run_dir, logs, lost=1, fault=fault, spare=True)
    spare, killed = sorted((logs[1].read_text(), logs[3].read_text()), key=lambda t: "this spare takes its place" not in t)
    assert "this spare takes its place" in spare, spare[-3000:]
    assert "healed from replica group" in spare.split("this spare takes its place")[1], spare[-3000:]
    # the killed process, started again by its torchrun, stood by in turn and ended with the run (or, on
    # a slow machine, started after the run's end and found it finished: while it waited to join, or from
    # the run's last snapshot)
    assert ((STANDS_BY in killed and "spare ends: the run finished while it stood by" in killed)
            or "the other replica groups finished the run" in killed
            or f"already at step {STEPS} of {STEPS}; nothing to train" in killed), killed[-3000:]
    # the spare's start, once it took the place: nothing built after the wait, its time from there on
    back = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "start" and r["time"] > fault[1]]
    assert back and back[0]["group"] == 1 and back[0]["s"]["data_load"] == back[0]["s"]["model"] == 0, back
    # the run over, the members' lock files are gone (each removed by its last holder)
    assert not [m for m in range(GROUPS) if lock_path(SECRET.encode(), m).exists()]


def kill_a_process_of_group_1_beside_its_spares(run_dir: Path, agents) -> tuple[int, float]:
    """Groups of two processes, group 1's command twice: once a spare waits on each of the group's two
    member locks (members 2 and 3; a waiter is a blocked lock in /proc/locks), SIGKILL the holder of
    member 3's, process 1 of the member torchrun."""
    from benchmarks.survivors import lock_holder, proc_locks

    step = wait_for_step(run_dir, 15, agents)
    locks = [lock_path(SECRET.encode(), m) for m in (2, 3)]
    deadline = time.time() + 120
    while True:
        if {str(p.stat().st_ino) if p.exists() else "-" for p in locks} <= proc_locks()[1]:
            break
        assert time.time() < deadline, "the spares never waited on both locks"
        time.sleep(0.05)
    os.kill(lock_holder(locks[1]), signal.SIGKILL)
    return step, time.time()


@pytest.mark.long
def test_a_group_of_two_processes_has_a_spare_for_each(tmp_path):
    """Groups of two processes (every process a member, half of its group's two shares), group 1's
    command started twice: the second torchrun's two processes stand by, one for each member. Process
    1 of group 1 is SIGKILLed: its torchrun stops the other and restarts both; the two spares take
    both places (their starts built nothing after the wait), heal and train; the restarted pair
    stands by in turn. Every step's samples and the final weights are those of the same job without
    the fault, bit for bit."""
    corpus, longer = make_corpus(tmp_path), (f"trainer.max_steps={LONG}", "replicas.shares_per_group=2")
    ref_dir, _, _ = run_job(tmp_path / "ref", corpus, procs=2, extra=longer)
    # (its command started again once the groups train: started together, a member of group 1 may be in each
    # command, and the fault then stops a spare, not the group's other member)
    run_dir, logs, fault = run_job(tmp_path, corpus, kill_a_process_of_group_1_beside_its_spares, procs=2,
                                   extra=longer, spares=(1,), spares_later=True)
    spare, killed = sorted((logs[1].read_text(), logs[3].read_text()), key=lambda t: "this spare takes its place" not in t)
    assert "healed from replica group" in spare.split("this spare takes its place")[1], spare[-3000:]
    assert STANDS_BY in killed or "finished the run" in killed, killed[-3000:]  # (it was the member until the fault)
    back = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "start" and r["time"] > fault[1]]
    assert len(back) == 2 and all(r["group"] == 1 and r["s"]["data_load"] == r["s"]["model"] == 0 for r in back), back
    assert shares_by_step(run_dir) == shares_by_step(ref_dir)
    weights, expected = final(run_dir, LONG), final(ref_dir, LONG)
    assert not differing(weights, expected), differing(weights, expected)


def epoch_with_all_after(run_dir: Path, agents, t: float, timeout: float = 180) -> dict:
    """The first epoch formed after `t` with every group in it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        back = [e for e in records(run_dir / "metrics.jsonl") if e.get("kind") == "epoch" and e["time"] > t
                and e["members"] == list(range(GROUPS))]
        if back:
            return back[0]
        assert any(a.poll() is None for a in agents), "every group ended"
        time.sleep(0.05)
    raise AssertionError(f"the groups were not back together after {timeout} s")


def a_node_and_a_group_down_then_all_down(tmp: Path, corpus: Path):
    """Overlapping faults: group 1's whole node lost (its agent and worker SIGKILLed; a new agent
    launched in their place) and at the same moment group 2's worker SIGKILLed, so group 0 is alone
    (no quorum of 2: it trains nothing until one returns); once all three are back, every group's
    worker SIGKILLed (they restart from the newest snapshot)."""
    def fault(run_dir: Path, agents: list) -> tuple[float, float]:
        wait_for_step(run_dir, 15, agents)
        workers, peers = [worker_of(a) for a in agents], peers_of(agents[1])
        t_two = time.time()
        agents[1].kill()  # (SIGKILL) the node's agent and its worker, together
        os.kill(workers[1], signal.SIGKILL)
        os.kill(workers[2], signal.SIGKILL)
        agents[1].wait()
        agents[1] = launch(1, peers, corpus, run_dir, tmp / "group1-relaunched.log")
        back = epoch_with_all_after(run_dir, agents, t_two)
        wait_for_step(run_dir, back["step"] + 3, agents)
        t_all = time.time()
        for worker in [worker_of(a) for a in agents]:
            os.kill(worker, signal.SIGKILL)
        epoch_with_all_after(run_dir, agents, t_all)
        return t_two, t_all
    return fault


def peers_of(agent: subprocess.Popen) -> list[str]:
    """The replicas.peers an agent was launched with (its command line)."""
    args = Path(f"/proc/{agent.pid}/cmdline").read_bytes().decode().split("\0")
    return next(a for a in args if a.startswith("replicas.peers=["))[len("replicas.peers=["):-1].split(",")


def test_overlapping_faults_a_lost_node_two_down_and_all_down_end_bitwise_equal(reference, tmp_path):
    run_dir, logs, (t_two, t_all) = run_job(tmp_path, reference["corpus"],
                                            a_node_and_a_group_down_then_all_down(tmp_path, reference["corpus"]),
                                            extra=("snapshot.every_steps=10",))
    recs = records(run_dir / "metrics.jsonl")
    # a lone group never trains: without a quorum (2 of 3) it waits for another
    assert all(len(r["members"]) >= 2 for r in recs if r.get("kind") in ("train", "epoch")), recs
    # the lost node's group came back with its new agent, healed from a live group, before all went down
    relaunched = (tmp_path / "group1-relaunched.log").read_text()
    assert "healed from replica group" in relaunched, relaunched[-3000:]
    assert not [r for r in recs if r.get("kind") == "resume" and r["time"] < t_all], "a snapshot read before all were down"
    # every group down: they restart from the newest snapshot, the steps since it trained again
    assert [r for r in recs if r.get("kind") == "resume" and r["time"] > t_all], "no snapshot read after all were down"
    assert shares_by_step(run_dir) == reference["shares"]
    weights = final(run_dir)
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)


LONG = 800
SHARDED = 200  # steps of the FSDP groups (their restart is back within 60 here)


def kill_one_process_of_group_1(run_dir, agents):
    """Once the six processes trained together, and 5 steps more: SIGKILL group 1's process 1."""
    deadline = time.time() + 120  # every process a member first (a slow start joins a later epoch)
    while not [e for e in records(run_dir / "metrics.jsonl") if e.get("kind") == "epoch" and len(e["members"]) == 6]:
        assert time.time() < deadline and all(a.poll() is None for a in agents), "the six never trained together"
        time.sleep(0.01)
    whole = [e for e in records(run_dir / "metrics.jsonl") if e.get("kind") == "epoch"][-1]
    step = wait_for_step(run_dir, whole["step"] + 5, agents)
    workers = Path(f"/proc/{agents[1].pid}/task/{agents[1].pid}/children").read_text().split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)
    return step, time.time()


def check_group_1_left_and_returned_whole(run_dir: Path, fault_t: float, fault_step: int) -> list:
    """Group 1 (members 2 and 3) left in one new epoch and came back healed in one more; no snapshot
    was read. Returns the run's records."""
    recs = records(run_dir / "metrics.jsonl")
    epochs = [r for r in recs if r.get("kind") == "epoch"]
    assert [0, 1, 2, 3, 4, 5] in [e["members"] for e in epochs]  # member 2g + i: group g's process i
    without = [e for e in epochs if not {2, 3} & set(e["members"]) and e["time"] >= fault_t]
    assert without and without[0]["members"] == [0, 1, 4, 5], epochs
    assert fault_step <= without[0]["step"], (fault_step, without[0])
    after = [e for e in epochs if e["time"] > without[0]["time"]]  # the two come back together, in one epoch
    assert {2, 3} <= set(after[-1]["members"]) and {2, 3} <= set(sum((e["healed"] for e in after), [])), epochs
    # a group leaves and returns whole: no epoch after the six first trained together holds half a group
    since = next(i for i, e in enumerate(epochs) if len(e["members"]) == 6)
    assert all({2 * g, 2 * g + 1} <= set(e["members"]) or not {2 * g, 2 * g + 1} & set(e["members"])
               for e in epochs[since:] for g in range(3)), epochs
    assert len(epochs[since:]) == 3, epochs  # the six; without group 1; the six again
    assert not [r for r in recs if r.get("kind") == "resume"], "a snapshot was read"
    return recs


@pytest.mark.long  # (CI: a process of a two-process group killed, the group healed whole: the FSDP variant below)
def test_groups_of_two_processes_lose_one_and_end_as_without_the_fault(reference, tmp_path):
    """Three groups of two processes (one torchrun each, every process a member, half of its group's
    two shares each: the split of the groups of one process). A process of group 1 is SIGKILLed: its
    torchrun restarts both, the other groups go on without them (one new epoch), and they come back
    healed (one more: a group leaves and returns whole). Every step's samples are those of the groups
    of one process; the final weights those of the same job without the fault, bit for bit (each
    process owns its shares: the exchange's tree is over members, so groups of one process add the
    same gradients in another order, equal to about 1e-7)."""
    # 800 steps: the restarted group (two new interpreters beside four busy ones: 10-12 s on 2 cores)
    # comes back well before the end
    longer = (f"trainer.max_steps={LONG}", "replicas.shares_per_group=2")
    one_dir, _, _ = run_job(tmp_path / "one", reference["corpus"], extra=longer[:1])
    ref_dir, _, _ = run_job(tmp_path / "ref", reference["corpus"], procs=2, extra=longer)
    run_dir, logs, (fault_step, fault_t) = run_job(tmp_path, reference["corpus"], kill_one_process_of_group_1,
                                                   procs=2, extra=longer)
    check_group_1_left_and_returned_whole(run_dir, fault_t, fault_step)
    assert shares_by_step(run_dir) == shares_by_step(ref_dir) == shares_by_step(one_dir)
    weights, expected = final(run_dir, LONG), final(ref_dir, LONG)
    assert not differing(weights, expected), differing(weights, expected)
    out = logs[1].read_text()
    # (its first start may already heal, when the others began before it: the line counts from there)
    assert re.search(rf"training from step \d+ to {LONG} on replica group 1 process 0 \(3 groups\)", out), out[-3000:]
    assert "group 1 process 1 was lost: its torchrun restarts the group's processes" in out, out[-3000:]


# tensor parallel over gloo: a step costs 3x FSDP's here (a collective per sub-layer), so one block
# and 80 steps (its restart is back within 35, at 10 s)
# (groups of several processes are -m long: CI's replica tests are groups of one process, and the
# sharded groups' shares: tests/unit/test_replicas.py)
@pytest.mark.parametrize("split, shown, steps", [pytest.param(("trainer.parallel=fsdp",), "fsdp", SHARDED,
                                                              marks=pytest.mark.long),
                                                 pytest.param(("trainer.tensor_parallel=2", "model.n_layer=1"),
                                                              "ddp x tensor parallel 2", 80, marks=pytest.mark.long)],
                         ids=["fsdp", "tp2"])
def test_groups_sharding_the_model_heal_each_shard_from_the_process_holding_it(reference, tmp_path, split, shown, steps):
    """FSDP (a fault-tolerant HSDP) or tensor parallelism inside each group, replicas across them:
    three groups of two processes, each group's two processes split the model and train each of its
    shares together (FSDP: a part of it each; tensor parallel: the whole share, a half of every block
    each). A process of group 1 is SIGKILLed: the others go on without the group, and when its
    torchrun has restarted both, each heals its own shard from the process of a live group that holds
    the same one (checked by its digest). Every step's samples and the final weights are those of
    the same job without the fault, bit for bit."""
    sharded = (f"trainer.max_steps={steps}", *split)
    ref_dir, _, _ = run_job(tmp_path / "ref", reference["corpus"], procs=2, extra=sharded)
    run_dir, logs, (fault_step, fault_t) = run_job(tmp_path, reference["corpus"], kill_one_process_of_group_1,
                                                   procs=2, extra=sharded)
    recs = check_group_1_left_and_returned_whole(run_dir, fault_t, fault_step)
    assert shares_by_step(run_dir) == shares_by_step(ref_dir)
    # (each shard healed right: a wrong one would change the sum of every later step, on every group)
    weights, expected = final(run_dir, steps), final(ref_dir, steps)
    assert not differing(weights, expected), differing(weights, expected)
    _, manifest = read_newest(SnapshotStore(str(run_dir / "snapshots")))
    assert (manifest["parallel"], manifest["world_size"]) == (shown.split()[0], 2)  # saved by one group, a shard each
    back = [e for e in recs if e.get("kind") == "epoch" and e["time"] > fault_t and e["healed"]]
    assert back and back[0]["healed"] == [2, 3], back  # both processes of group 1, each its own shard
    out = logs[1].read_text()
    # (its first start may already heal, when the others began before it: the line counts from there)
    assert re.search(rf"training from step \d+ to {steps} on replica group 1 process 0 \(3 groups\) "
                     rf"\({re.escape(shown)}\)", out), out[-3000:]
    assert "its torchrun restarts the group's processes, which rejoin and heal from a live group" in out, out[-3000:]
    assert re.search(r"healed from replica group [02] process 0: at step", out), out[-3000:]


def test_a_group_that_waits_while_the_others_finish_ends_with_the_run(reference, tmp_path):
    """A group restarted near the end waits for a quorum that will not come: when the run's last
    snapshot appears it ends (exit 0) instead of waiting for ever."""
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(3)]  # below the ephemeral range
    run_dir = tmp_path / "run"
    log = tmp_path / "g0.log"
    agent = launch(0, peers, reference["corpus"], run_dir, log)
    try:
        deadline = time.time() + 120
        while "waits for a quorum" not in log.read_text():  # alone: 1 of 3 groups
            assert agent.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        last = SnapshotStore(str(reference["run_dir"] / "snapshots")).list()[-1]  # the others' last snapshot
        shutil.copytree(last.path, run_dir / "snapshots" / Path(last.path).name)
        assert agent.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert "the other replica groups finished the run" in log.read_text()


def test_a_group_without_the_secret_is_refused(tmp_path):
    """A process that does not hold the job secret is not let in: its beacon is refused, and the
    group it pretends to be never joins an epoch."""
    corpus = make_corpus(tmp_path)
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(3)]  # below the ephemeral range
    run_dir = tmp_path / "run"
    good = [launch(g, peers, corpus, run_dir, tmp_path / f"g{g}.log") for g in (0, 1)]
    cmd = torchrun_cmd(1, "mingpt/main.py", *CFG, f"data.path={corpus}", f"trainer.run_dir={tmp_path / 'intruder'}",
                       f"replicas.peers=[{','.join(peers)}]", "replicas.group=2")
    intruder = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(MINGPT_JOB_SECRET=secrets.token_hex(32)),
                                stdout=(tmp_path / "g2.log").open("w"), stderr=subprocess.STDOUT)
    try:
        codes = [a.wait(timeout=240) for a in good]
    finally:
        intruder.kill()
        intruder.wait()
    assert codes == [0, 0]
    epochs = [r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"]
    assert epochs and all(2 not in e["members"] for e in epochs), epochs
    assert "dropped a connection that did not prove the job secret" in (tmp_path / "g0.log").read_text()


def test_two_groups_without_faults_end_bitwise_equal_to_ddp_at_two_ranks(tmp_path):
    """Issue 35's "correct by construction": two groups sum their two shares as DDP's two ranks do
    (a + b = b + a, and DDP's halving of gradients that the loss doubled is exact), so the runs are
    bitwise equal. (Three are not: a third is no power of two, and gloo's ring sums each chunk from
    another rank; docs/replicas.md gives the difference.)"""
    corpus = make_corpus(tmp_path)
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(2)]  # below the ephemeral range
    groups_dir, ddp_dir = tmp_path / "groups", tmp_path / "ddp"
    logs = [tmp_path / f"group{g}.log" for g in range(2)]
    agents = [launch(g, peers, corpus, groups_dir, logs[g]) for g in range(2)]
    try:
        ddp = subprocess.run(torchrun_cmd(2, "mingpt/main.py", *CFG, f"data.path={corpus}",
                                          f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={ddp_dir}"),
                             cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    groups, reference = final(groups_dir), final(ddp_dir)
    assert all(torch.equal(groups[k], reference[k]) for k in reference)


def test_a_stop_signal_to_every_group_saves_the_last_step_trained_and_the_same_commands_resume(reference, tmp_path):
    """scancel, or a time limit's signal: every group's torchrun gets SIGTERM, a moment apart. A signal
    stops the group it reached, after a step (the others train on: the survivors' case, test_replica_slots);
    each group that leaves has the epoch's saver save that step, so the newest snapshot is the last step
    any group trained. The same commands started again resume from it and end as the run never stopped."""
    run_dir = tmp_path / "run"
    peers = [f"127.0.0.1:{port}" for port in free_port_runs(GROUPS)]
    logs = [tmp_path / f"group{g}.log" for g in range(GROUPS)]
    agents = [launch(g, peers, reference["corpus"], run_dir, logs[g]) for g in range(GROUPS)]
    try:
        wait_for_step(run_dir, 30, agents)
        for agent in agents:  # (group 0 first: the coordinator and saver)
            agent.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        codes = [a.wait(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(codes), "a stopped group must not look finished to its scheduler"
    trained = max(r["step"] for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train")
    assert trained < STEPS and [s.step for s in SnapshotStore(str(run_dir / "snapshots")).list() if s.committed][-1] == trained
    assert "leaves the job after step" in logs[0].read_text(), logs[0].read_text()[-3000:]
    # (it left while the others trained on: its line says that, and no other line that its snapshot resumes)
    assert "the same command resumes from it" not in logs[0].read_text(), logs[0].read_text()[-3000:]
    agents = [launch(g, peers, reference["corpus"], run_dir, tmp_path / f"again{g}.log") for g in range(GROUPS)]
    try:
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert codes == [0] * GROUPS
    # the groups up first form the first epoch and load the snapshot; a group that starts later (a loaded
    # node: group 0 came 12 s after the others here) heals from them at the step they reached
    resumed = [re.findall(r"resumed from snapshot step (\d+)", (tmp_path / f"again{g}.log").read_text())
               for g in range(GROUPS)]
    assert any(resumed) and {int(step) for steps in resumed for step in steps} == {trained}, resumed
    assert shares_by_step(run_dir) == reference["shares"]
    weights = final(run_dir)
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)
