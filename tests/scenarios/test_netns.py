"""Two "nodes" in their own network namespaces, joined by a veth pair; cutting the link shows the
partition path: the survivor's collective stalls, the process-group timeout / watchdog ends the
stuck worker, torchrun restarts it, and training goes on at WORLD_SIZE=1."""

import os
import signal
import subprocess
import time

import pytest
from conftest import REPO, free_port, make_corpus, records, torchrun_env
from test_elastic import CFG

from benchmarks.netns import agent_cmd, sh

pytestmark = pytest.mark.slow


def test_link_cut_partition_survivor_goes_on_alone(two_nodes, tmp_path):
    corpus = make_corpus(tmp_path)
    run_dir, port = tmp_path / "run", free_port()
    procs = {}
    for name in ("a", "b"):
        veth = two_nodes[name].veth
        cmd = agent_cmd(two_nodes[name], two_nodes["a"], port, 1, "mingpt/main.py",
                        *[c for c in CFG if "max_steps" not in c], "trainer.max_steps=600", f"data.path={corpus}",
                        f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}", "dist.timeout_s=10",
                        "trainer.watchdog_s=20", run_id="netns-test")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(GLOO_SOCKET_IFNAME=veth),
                                       stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)
        time.sleep(0.5)


    try:
        deadline = time.time() + 120
        while not any(r.get("world_size") == 2 and r.get("step", 0) >= 30 for r in records(run_dir / "metrics.jsonl")):
            assert time.time() < deadline and all(p.poll() is None for p in procs.values()), \
                (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.1)
        ns_b, veth_b = two_nodes["b"].ns, two_nodes["b"].veth
        sh("ip", "-n", ns_b, "link", "set", veth_b, "down")  # the partition
        t_cut = time.time()
        deadline = time.time() + 150
        while not any(r["kind"] == "resume" and r["world_size"] == 1 for r in records(run_dir / "metrics.jsonl")):
            assert time.time() < deadline, (tmp_path / "a.log").read_text()[-4000:]
            time.sleep(0.2)
        recovered_s = time.time() - t_cut
        print(f"\n[netns] after the link cut, node A resumed alone in {recovered_s:.1f} s")
        assert procs["a"].wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-4000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    train = [r for r in records(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert max(r["step"] for r in train) == 600
    assert train[-1]["world_size"] == 1
    log_a = (tmp_path / "a.log").read_text()
    assert "made no progress" in log_a or "lost contact with a peer: " in log_a
