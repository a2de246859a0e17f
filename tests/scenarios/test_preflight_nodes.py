"""Multi-node preflight on real agents: a snapshot dir that is not shared (network namespaces with
private mounts), two copies of the code, a corpus on one node only, the doctor's table, and an
endpoint nobody listens on."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, make_corpus, torchrun_env

TINY = ["model=custom", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
        "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.max_steps=4"]


RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10"


def agent(port: int, *args: str, cwd=REPO, extra_env=None, script="mingpt/main.py"):
    """One torchrun agent of a 2-node job on loopback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=preflight-test", f"--rdzv_conf={RDZV}", "--max-restarts=0",
           script, *args]
    return subprocess.Popen(cmd, cwd=cwd, env=torchrun_env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def both(a, b, timeout=180):
    out = []
    for p in (a, b):
        try:
            out.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out.append(p.communicate()[0])
    return (a.returncode, b.returncode), out


@pytest.mark.slow
def test_two_copies_of_the_code_that_differ_in_one_file_are_refused(tmp_path):
    corpus = make_corpus(tmp_path)
    copies = []
    for name in ("a", "b"):
        shutil.copytree(REPO / "mingpt", tmp_path / name / "mingpt", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(REPO / "conf", tmp_path / name / "conf")
        copies.append(tmp_path / name)
    with open(copies[1] / "mingpt" / "model" / "gpt.py", "a") as fh:
        fh.write("\n# a local edit on one node\n")
    port = free_port()
    common = [*TINY, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={tmp_path / 'run'}"]
    procs = [agent(port, *common, cwd=c, extra_env={"PYTHONPATH": str(c)}, script=str(c / "mingpt" / "main.py"))
             for c in copies]
    codes, out = both(*procs)
    assert codes[0] != 0 and codes[1] != 0
    text = "".join(out)
    assert "mingpt's code differs between nodes" in text and "(mingpt/model/gpt.py)" in text, text[-3000:]
    assert "runs other files than rank 0" in text


@pytest.mark.slow
def test_a_corpus_missing_on_one_node_is_named(tmp_path):
    port = free_port()
    homes = [tmp_path / "node-a", tmp_path / "node-b"]
    for h in homes:
        h.mkdir()
    make_corpus(homes[0])  # corpus.txt on node a only
    common = [*TINY, "data.path=corpus.txt", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={tmp_path / 'run'}"]
    procs = [agent(port, *common, cwd=h, extra_env={"PYTHONPATH": str(REPO)}, script=str(REPO / "mingpt" / "main.py"))
             for h in homes]
    codes, out = both(*procs)
    text = "".join(out)
    assert codes[0] != 0 and codes[1] != 0
    assert "data.path=corpus.txt is missing on" in text and "but present on the other nodes" in text, text[-3000:]


def netns_agents(two_nodes, tmp_path, run_dir: Path, private: bool):
    corpus = make_corpus(tmp_path)
    port, procs = free_port(), []
    for name in ("a", "b"):
        ns, veth, addr = two_nodes[name].ns, two_nodes[name].veth, two_nodes[name].addr
        inner = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                 "--rdzv_backend=c10d", f"--rdzv_endpoint={two_nodes['a'].addr}:{port}", "--rdzv_id=netns-preflight",
                 f"--rdzv_conf={RDZV},is_host={int(name == 'a')}", f"--local-addr={addr}", "--max-restarts=0",
                 "mingpt/main.py", *TINY, f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                 f"trainer.run_dir={run_dir}"]
        # each "node" sees its own run directory when private: a tmpfs mounted over it in its own mount namespace
        script = (f"mount -t tmpfs tmpfs {run_dir} && " if private else "") + "exec " + " ".join(inner)
        cmd = ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(GLOO_SOCKET_IFNAME=veth), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        time.sleep(0.5)
    return both(*procs)


@pytest.mark.slow
def test_a_local_snapshot_dir_not_shared_between_nodes_is_refused(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    codes, out = netns_agents(two_nodes, tmp_path, run_dir, private=True)
    text = "".join(out)
    assert codes[0] != 0 and codes[1] != 0, text[-3000:]
    assert f"snapshot.dir={run_dir}/snapshots is not shared between nodes" in text, text[-3000:]


@pytest.mark.slow
def test_the_same_with_one_shared_directory_passes(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    codes, out = netns_agents(two_nodes, tmp_path, run_dir, private=False)
    assert codes == (0, 0), "".join(out)[-3000:]
    passed = [line for line in "".join(out).splitlines() if "preflight checks passed on 2 ranks" in line]
    assert passed
    print("\n[netns] " + passed[0])


@pytest.mark.slow
def test_the_doctor_prints_its_table_on_two_agents(tmp_path):
    corpus = make_corpus(tmp_path)
    port = free_port()
    args = [*TINY, f"data.path={corpus}", f"trainer.run_dir={tmp_path / 'run'}"]
    procs = [agent(port, *args, script="mingpt/cli/doctor.py", extra_env={"PYTHONPATH": str(REPO)}) for _ in "ab"]
    codes, out = both(*procs)
    text = "".join(out)
    assert codes == (0, 0), text[-3000:]
    for expected in ("world size 2 on 2 node(s)", "network:", "  node 0 ", "  node 1 ", "all-reduce:", "all ranks",
                     "snapshot store", "same bytes", "ok: the job would start"):
        assert expected in text, (expected, text[-3000:])


@pytest.mark.slow
def test_an_endpoint_nobody_listens_on_fails_with_one_clear_line_in_bounded_time(tmp_path):
    port = free_port()  # nothing listens there
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "mingpt.cli.launch", "--nnodes=1:2", "--nproc_per_node=1",
                           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=dead",
                           "--rdzv_conf=is_host=0,read_timeout=3", "mingpt/main.py"],
                          cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mingpt-torchrun: cannot reach the rendezvous store at 127.0.0.1:{port} within "
                           "read_timeout=3 s") and "firewalls" in last
    assert elapsed < 4 * 3 + 10  # about twice read_timeout, plus start-up
