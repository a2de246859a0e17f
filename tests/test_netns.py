"""Two "nodes" in their own network namespaces, joined by a veth pair; cutting the link shows the
partition path: the survivor's collective stalls, the process-group timeout / watchdog ends the
stuck worker, torchrun restarts it, and training goes on at WORLD_SIZE=1."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, free_port, make_corpus, torchrun_env
from test_elastic import CFG, RDZV_CONF

pytestmark = pytest.mark.slow

ADDR_A, ADDR_B = "10.231.7.1", "10.231.7.2"  # only inside the namespaces this test creates


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@pytest.fixture
def two_nodes():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command: network namespaces cannot be made here")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, veth_a, veth_b = f"mga{tag}", f"mgb{tag}", f"va{tag}", f"vb{tag}"
    if sh("ip", "netns", "add", ns_a, check=False).returncode != 0:
        pytest.skip("creating network namespaces is not permitted here (needs root / CAP_NET_ADMIN)")
    try:
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for ns, veth, addr in ((ns_a, veth_a, ADDR_A), (ns_b, veth_b, ADDR_B)):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"a": (ns_a, veth_a, ADDR_A), "b": (ns_b, veth_b, ADDR_B)}
    finally:
        sh("ip", "netns", "del", ns_a, check=False)
        sh("ip", "netns", "del", ns_b, check=False)


def test_link_cut_partition_survivor_goes_on_alone(two_nodes, tmp_path):
    corpus = make_corpus(tmp_path)
    run_dir, port = tmp_path / "run", free_port()
    procs = {}
    for name in ("a", "b"):
        ns, veth, addr = two_nodes[name]
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={ADDR_A}:{port}",
               # inside a namespace torchrun cannot tell that the endpoint address is its own: say so
               "--rdzv_id=netns-test", f"--rdzv_conf={RDZV_CONF},is_host={int(name == 'a')}",
               f"--local-addr={addr}", "--max-restarts=3",
               "--monitor-interval=0.5", "mingpt/main.py", *[c for c in CFG if "max_steps" not in c],
               "trainer.max_steps=600", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
               f"trainer.run_dir={run_dir}", "dist.timeout_s=10", "trainer.watchdog_s=20"]
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(GLOO_SOCKET_IFNAME=veth),
                                       stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)
        time.sleep(0.5)

    def records():
        p = run_dir / "metrics.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    try:
        deadline = time.time() + 120
        while not any(r.get("world_size") == 2 and r.get("step", 0) >= 30 for r in records()):
            assert time.time() < deadline and all(p.poll() is None for p in procs.values()), \
                (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.1)
        ns_b, veth_b, _ = two_nodes["b"]
        sh("ip", "-n", ns_b, "link", "set", veth_b, "down")  # the partition
        t_cut = time.time()
        deadline = time.time() + 150
        while not any(r["kind"] == "resume" and r["world_size"] == 1 for r in records()):
            assert time.time() < deadline, (tmp_path / "a.log").read_text()[-4000:]
            time.sleep(0.2)
        recovered_s = time.time() - t_cut
        print(f"\n[netns] after the link cut, node A resumed alone in {recovered_s:.1f} s")
        assert procs["a"].wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-4000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    train = [r for r in records() if r["kind"] == "train"]
    assert max(r["step"] for r in train) == 600
    assert train[-1]["world_size"] == 1
    log_a = (tmp_path / "a.log").read_text()
    assert "made no progress" in log_a or "timed out" in log_a.lower() or "Connection" in log_a
