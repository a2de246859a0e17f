"""The Dockerfile, built and run (podman, on a local base: see tests/image_base.py): its commands,
training as the recipe in its header says, and two containers as two nodes that lose and take
back one of them. The CUDA base and GPUs cannot be tested here."""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, free_port, make_corpus, read_metrics, records
from image_base import PODMAN, ULIMITS, image_fixture  # noqa: F401 - the session's image

from mingpt.snapshot import SnapshotStore
from mingpt.snapshot.restore import read_newest

pytestmark = pytest.mark.slow

RECIPE = (REPO / "Dockerfile").read_text().split("\nFROM", 1)[0]
STOP_TIMEOUT = re.search(r"--stop-timeout (\d+)", RECIPE).group(1)
TORCHRUN = [re.search(rf"{flag}=\S+", RECIPE).group(0) for flag in ("--rdzv_conf", "--max-restarts", "--shutdown-timeout")]
# gpt-nano on a tiny corpus; max_steps out of reach: each test stops the job itself
TRAIN = ["-m", "mingpt.main", "model=gpt-nano", "data.path=/data/mingpt/corpus.txt", "data.block_size=32",
         "trainer.batch_size=4", "trainer.micro_batch_size=2", "trainer.log_every=1", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.max_steps=1000000", "snapshot.every_steps=5"]
UID = 1000  # the image's user


def wait_until(cond, procs: list, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert all(p.poll() is None for p in procs), f"a container exited while waiting for {what}"
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def volume(tmp: Path, name: str) -> Path:
    """A host directory for /data/mingpt that the image's user owns (the recipe's install -d), with the corpus."""
    vol = tmp / name
    vol.mkdir()
    make_corpus(vol)
    for p in (vol, vol / "corpus.txt"):
        os.chown(p, UID, UID)
    return vol


def run_cmd(image: str, name: str, vol: Path, *args: str, env: tuple[str, ...] = ()) -> list[str]:
    """The recipe's `docker run`, less --gpus: the run directory on the volume, HOME there, variables by
    name; gloo on loopback (it would take the address the host name resolves to)."""
    return [*PODMAN, "run", "--rm", "--name", name, *ULIMITS, "--network", "host", "--ipc", "host",
            "--stop-timeout", STOP_TIMEOUT, "-v", f"{vol}:/data/mingpt", "-e", "HOME=/data/mingpt",
            "-e", "GLOO_SOCKET_IFNAME=lo", *(f"--env={n}" for n in env), image, *args]


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def remove(*names: str) -> None:
    # --ignore: one that is gone already (--rm) must not keep the others running
    subprocess.run([*PODMAN, "rm", "--force", "--ignore", "--time", "0", *names], capture_output=True, timeout=120)


def test_every_command_runs_in_the_image_as_its_user(image):
    """Every console script and every module the READMEs name answers --help, far from any source
    tree, as uid 1000; the config is composed from the installed package."""
    from test_docker import readme_entries

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    commands = [[name] for name in scripts] + [["python", "-m", m] for m in sorted(readme_entries())]
    code = f"""
import json, os, subprocess, pyarrow, zstandard, boto3
from concurrent.futures import ThreadPoolExecutor
from mingpt.config.compose import config_dir, compose
print(json.dumps([os.getuid(), os.getcwd(), str(config_dir()), compose(['model=gpt2', 'snapshot=s3']).snapshot.dir,
                  compose(['experiment=finetune_shakespeare']).model.init_from]))
def run(cmd):
    out = subprocess.run([*cmd, '--help'], capture_output=True, text=True)
    return json.dumps([cmd, out.returncode, out.stdout, out.stderr[-1000:]])
with ThreadPoolExecutor(4) as pool:  # each one imports torch: a few seconds
    print(*pool.map(run, {commands!r}), sep="\\n")
"""
    out = subprocess.run([*PODMAN, "run", "--rm", *ULIMITS, "--entrypoint", "python", image, "-c", code],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    first, *answers = map(json.loads, out.stdout.strip().splitlines())
    uid, cwd, conf, snapdir, init_from = first
    assert (uid, cwd) == (UID, "/home/mingpt")
    assert conf.endswith("site-packages/mingpt/conf") and snapdir.startswith("s3://") and init_from == "gpt2"
    assert [cmd for cmd, *_ in answers] == commands
    for cmd, rc, stdout, stderr in answers:
        assert rc == 0 and stdout.strip(), f"{' '.join(cmd)} --help: {stderr}"
    assert "--rdzv_endpoint" in answers[list(scripts).index("mingpt-torchrun")][2]  # torchrun's own arguments


def test_a_stopped_container_saves_and_the_same_run_resumes(image, tmp_path):
    """`podman stop` gives the recipe's stop timeout: the workers save, the container exits 75, and
    the same command resumes from that snapshot, on the volume, written as uid 1000."""
    vol, name, log = volume(tmp_path, "data"), f"mingpt-test-{uuid.uuid4().hex[:8]}", tmp_path / "run.log"
    cmd = run_cmd(image, name, vol, "--standalone", "--nproc_per_node=2", TORCHRUN[-1], *TRAIN,
                  "trainer.run_dir=/data/mingpt/runs/run1")
    metrics = vol / "runs" / "run1" / "metrics.jsonl"

    def stop_after(step: int, kind: str) -> int:
        proc = start(cmd, log)
        try:
            wait_until(lambda: any(r.get("kind") == kind and r.get("step", 0) >= step for r in records(metrics)), [proc],
                       timeout=300, what=f"a {kind} record at step {step} or later")
            subprocess.run([*PODMAN, "stop", name], capture_output=True, timeout=int(STOP_TIMEOUT) + 60)
            return proc.wait(timeout=60)
        finally:
            remove(name)

    assert stop_after(3, "train") == 75, log.read_text()[-3000:]
    saved = re.findall(r"snapshot of step (\d+) saved; the same command resumes from it", log.read_text())
    assert saved, log.read_text()[-3000:]
    stopped_at = int(saved[-1])
    assert stop_after(stopped_at + 2, "train") == 75, log.read_text()[-3000:]
    assert f"resumed from snapshot step {stopped_at}" in log.read_text(), log.read_text()[-3000:]
    assert [r["step"] for r in records(metrics) if r["kind"] == "resume"] == [stopped_at]
    steps = [r["step"] for r in records(metrics) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[0] == 1  # every step once, none repeated after the resume
    assert metrics.stat().st_uid == UID and (vol / "runs" / "run1" / "snapshots").stat().st_uid == UID


def test_two_containers_as_two_nodes_lose_one_and_take_it_back(image, s3, tmp_path):
    """Two containers with --network host rendezvous (the job's secret passed by name), snapshot to
    S3 on the host; one is killed, the other goes on alone from the newest snapshot, and the killed
    one started again rejoins."""
    import s3fs

    bucket, port, tag = f"img-{uuid.uuid4().hex[:10]}", free_port(), uuid.uuid4().hex[:8]
    s3fs.S3FileSystem().mkdir(bucket)
    cache = f"/dev/shm/mingpt-test-{tag}"  # --ipc host: the host's /dev/shm
    env = {**os.environ, "MINGPT_JOB_SECRET": secrets.token_hex(32)}
    names = {"a": f"mingpt-test-a-{tag}", "b": f"mingpt-test-b-{tag}"}
    vols = {n: volume(tmp_path, f"data-{n}") for n in names}
    aws = ("MINGPT_JOB_SECRET", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")

    def node(n: str) -> subprocess.Popen:
        # two nodes on one host: each its own loopback address, or both would be <host>_<pid 1> to the rendezvous
        cmd = run_cmd(image, names[n], vols[n], "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=mingpt",
                      f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=run2", f"--local-addr=127.0.0.{1 + (n == 'b')}",
                      *TORCHRUN, *TRAIN, "trainer.run_dir=/data/mingpt/runs/run2", "snapshot=s3",
                      f"snapshot.dir=s3://{bucket}/run2", f"snapshot.node_cache_dir={cache}", env=aws)
        return start(cmd, tmp_path / f"{n}.log", env)

    def resumes() -> list[int]:
        return [r["world_size"] for r in records(vols["a"] / "runs" / "run2" / "metrics.jsonl") if r["kind"] == "resume"]

    metrics = vols["a"] / "runs" / "run2" / "metrics.jsonl"  # rank 0's: node a hosts the rendezvous
    a = node("a")
    procs = [a]
    try:
        wait_until(lambda: listening(port), procs, timeout=120, what="node a hosting the rendezvous")
        procs.append(node("b"))
        # a snapshot of both nodes committed: node a goes on from it (with none, it would start over)
        wait_until(lambda: re.search(r"snapshot step \d+ committed to s3://\S+ by 2 writers",
                                     (tmp_path / "a.log").read_text()), procs, timeout=300, what="training at world size 2")
        subprocess.run([*PODMAN, "kill", names["b"]], capture_output=True, timeout=120)
        procs[1].wait(timeout=120)
        wait_until(lambda: resumes() == [1], [a], timeout=300, what="node a going on alone")
        alone = max(r["step"] for r in records(metrics) if r["kind"] == "resume")
        # past its next snapshot: the returning node resumes from what node a saved alone
        wait_until(lambda: any(r.get("world_size") == 1 and r["step"] > alone + 5 for r in records(metrics)), [a],
                   timeout=300, what="node a training alone")
        t_alone = time.time()
        procs.append(node("b"))
        wait_until(lambda: resumes() == [1, 2], [a, procs[2]], timeout=300, what="node b rejoining")
        back = max(r["step"] for r in records(metrics) if r["kind"] == "resume")
        wait_until(lambda: any(r.get("world_size") == 2 and r["step"] >= back + 3 for r in records(metrics)),
                   [a, procs[2]], timeout=300, what="training at world size 2 again")
        print(f"\nnode b rejoined {time.time() - t_alone:.1f} s after it was started again")
        # before the teardown: removing both containers at once can take b first, and a says so again
        before_teardown = (tmp_path / "a.log").read_text()
    finally:
        remove(*names.values())
        shutil.rmtree(cache, ignore_errors=True)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    assert before_teardown.count("lost contact with a peer") == 1, before_teardown[-4000:]
    assert "Traceback" not in logs["a"], logs["a"][-4000:]
    assert re.search(r"\[rank 1/2\] INFO mingpt.node: \S+ joined", logs["b"]), logs["b"][-3000:]
    train = read_metrics(metrics)  # step -> its last record (steps after the newest snapshot are trained again)
    assert sorted(train) == list(range(1, max(train) + 1))  # nothing skipped
    sizes = [train[s]["world_size"] for s in sorted(train)]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    # each resume loaded a snapshot (none started over) from the S3 server on the host, the second
    # one saved by node a alone
    starts = [r["step"] for r in records(metrics) if r["kind"] == "resume"]
    assert 0 < starts[0] < starts[1], starts
    _, manifest = read_newest(SnapshotStore(f"s3://{bucket}/run2"))
    assert manifest["step"] >= starts[1]
    for n in "ab":
        assert env["MINGPT_JOB_SECRET"] not in logs[n] and os.environ["AWS_SECRET_ACCESS_KEY"] not in logs[n]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


KILL_MEMBER = """
import os, signal
for p in filter(str.isdigit, os.listdir("/proc")):  # the entrypoint torchrun's worker (an exec'd one is no child of PID 1)
    try:
        ppid = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
        if ppid == "1" and b"mingpt.main" in open(f"/proc/{p}/cmdline", "rb").read():
            os.kill(int(p), signal.SIGKILL)
            print("killed", p)
    except OSError:
        pass
"""


@pytest.mark.long  # (CI: a spare's takeover in test_replica_groups.py, the image's two nodes below)
def test_a_warm_spare_exec_d_in_a_groups_container_takes_a_killed_members_place(image, tmp_path):
    """docs/replicas.md, Docker: two replica groups as two containers (--network host); group 1's spare
    is the same command run again with `podman exec` in its container (its /tmp, its network). The
    member's worker SIGKILLed: the spare takes its place and heals from group 0, and the job trains on
    with both groups."""
    vol, tag = volume(tmp_path, "data"), uuid.uuid4().hex[:8]
    names = [f"mingpt-test-g{g}-{tag}" for g in range(2)]
    peers = f"replicas.peers=[127.0.0.1:{free_port()},127.0.0.1:{free_port()}]"
    env = {**os.environ, "MINGPT_JOB_SECRET": secrets.token_hex(32)}
    group = ["--standalone", "--nproc_per_node=1", "--max-restarts=100", *TRAIN, "trainer.run_dir=/data/mingpt/runs/r",
             peers, "replicas.min_groups=1"]
    logs = [tmp_path / f"g{g}.log" for g in range(2)] + [tmp_path / "spare.log"]
    procs = [start(run_cmd(image, names[g], vol, *group, f"replicas.group={g}", env=("MINGPT_JOB_SECRET",)), logs[g], env)
             for g in range(2)]
    metrics = vol / "runs" / "r" / "metrics.jsonl"
    try:
        wait_until(lambda: any(r.get("kind") == "train" and r.get("members") == [0, 1] for r in records(metrics)), procs,
                   timeout=300, what="both groups training")
        procs.append(start([*PODMAN, "exec", "-e", "MINGPT_JOB_SECRET", names[1], "mingpt-torchrun", *group,
                            "replicas.group=1"], logs[2], env))
        wait_until(lambda: "stands by as its spare" in logs[2].read_text(), procs, timeout=300, what="the spare standing by")
        killed = subprocess.run([*PODMAN, "exec", names[1], "python", "-c", KILL_MEMBER], capture_output=True, text=True,
                                timeout=60)
        assert killed.stdout.count("killed") == 1, killed.stdout + killed.stderr
        wait_until(lambda: "healed from replica group 0" in logs[2].read_text(), procs, timeout=120,
                   what="the spare in its member's place")
        took = len(records(metrics))
        wait_until(lambda: sum(r.get("kind") == "train" and r.get("members") == [0, 1] for r in records(metrics)[took:]) >= 3,
                   procs, timeout=120, what="both groups training again")
        # the container's torchrun restarted its worker: it finds the member's place taken, and stands by in turn
        wait_until(lambda: "stands by as its spare" in logs[1].read_text(), procs, timeout=300, what="the next spare")
    finally:
        remove(*names)
    spare = logs[2].read_text()
    assert "this spare takes its place" in spare and "Traceback" not in spare, spare[-3000:]
