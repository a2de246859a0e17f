"""Two "nodes" on one machine: two network namespaces joined by a veth pair, each with its own
address (10.231.N.1 and .2). Needs root (CAP_NET_ADMIN); the traffic never leaves the machine.
Processes started with `ip netns exec NS ...` on one side reach the other only across the pair, so
its byte counters are exactly the traffic between the nodes."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import uuid
from dataclasses import dataclass


class NoNamespaces(RuntimeError):
    """Network namespaces cannot be made here (no `ip`, or not root)."""


@dataclass(frozen=True)
class Node:
    ns: str
    veth: str
    addr: str

    def prefix(self) -> list[str]:
        """What runs a command inside this node."""
        return ["ip", "netns", "exec", self.ns]


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@contextlib.contextmanager
def two_nodes(subnet: int = 231):
    """(node a, node b), torn down on exit."""
    if shutil.which("ip") is None:
        raise NoNamespaces("no `ip` command: network namespaces cannot be made here")
    tag = uuid.uuid4().hex[:6]
    a = Node(f"mga{tag}", f"va{tag}", f"10.{subnet}.7.1")
    b = Node(f"mgb{tag}", f"vb{tag}", f"10.{subnet}.7.2")
    if sh("ip", "netns", "add", a.ns, check=False).returncode != 0:
        raise NoNamespaces("creating network namespaces is not permitted here (needs root / CAP_NET_ADMIN)")
    try:
        sh("ip", "netns", "add", b.ns)
        sh("ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        for node in (a, b):
            sh("ip", "link", "set", node.veth, "netns", node.ns)
            sh("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.veth)
            sh("ip", "-n", node.ns, "link", "set", node.veth, "up")
            sh("ip", "-n", node.ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        sh("ip", "netns", "del", a.ns, check=False)
        sh("ip", "netns", "del", b.ns, check=False)


def link_bytes(node: Node, device: str | None = None) -> int:
    """Bytes that crossed the link so far, both ways (node's veth: sent plus received); with
    device="lo", the bytes its processes sent each other inside the node (counted once)."""
    out = json.loads(sh("ip", "-n", node.ns, "-s", "-j", "link", "show", device or node.veth).stdout)
    if device == "lo":
        return int(out[0]["stats64"]["tx"]["bytes"])
    stats = out[0]["stats64"]
    return int(stats["tx"]["bytes"]) + int(stats["rx"]["bytes"])


RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10"


def agent_cmd(node: Node, host: Node, port: int, nproc: int, *args: str, nnodes: str = "1:2", max_restarts: int = 3,
              run_id: str = "netns") -> list[str]:
    """A torchrun agent in `node`, its rendezvous on `host` (which hosts the c10d store), training
    mingpt with `args`. Run it with env GLOO_SOCKET_IFNAME=node.veth."""
    import sys

    # inside a namespace torchrun cannot tell that the endpoint address is its own: say so (is_host)
    return [*node.prefix(), sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc}", "--rdzv_backend=c10d", f"--rdzv_endpoint={host.addr}:{port}",
            f"--rdzv_id={run_id}", f"--rdzv_conf={RDZV_CONF},is_host={int(node == host)}", f"--local-addr={node.addr}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *args]


@dataclass(frozen=True)
class Bridged:
    """Nodes joined through a bridge in a hub namespace; `cut` takes one node's link down, `mend` back up."""
    hub: str
    nodes: list[Node]

    def cut(self, node: Node) -> None:
        sh("ip", "-n", self.hub, "link", "set", f"h{node.veth}", "down")

    def mend(self, node: Node) -> None:
        sh("ip", "-n", self.hub, "link", "set", f"h{node.veth}", "up")


@contextlib.contextmanager
def bridged_nodes(n: int, subnet: int = 232):
    """n nodes (10.{subnet}.9.1, .2, ...) on one bridge, torn down on exit."""
    if shutil.which("ip") is None:
        raise NoNamespaces("no `ip` command: network namespaces cannot be made here")
    tag = uuid.uuid4().hex[:5]
    hub = f"mgh{tag}"
    if sh("ip", "netns", "add", hub, check=False).returncode != 0:
        raise NoNamespaces("creating network namespaces is not permitted here (needs root / CAP_NET_ADMIN)")
    nodes = [Node(f"mg{i}{tag}", f"v{i}{tag}", f"10.{subnet}.9.{i + 1}") for i in range(n)]
    try:
        sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", hub, "link", "set", "br0", "up")
        for node in nodes:
            sh("ip", "netns", "add", node.ns)
            sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", f"h{node.veth}")
            sh("ip", "link", "set", node.veth, "netns", node.ns)
            sh("ip", "link", "set", f"h{node.veth}", "netns", hub)
            sh("ip", "-n", hub, "link", "set", f"h{node.veth}", "master", "br0")
            sh("ip", "-n", hub, "link", "set", f"h{node.veth}", "up")
            sh("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.veth)
            sh("ip", "-n", node.ns, "link", "set", node.veth, "up")
            sh("ip", "-n", node.ns, "link", "set", "lo", "up")
        yield Bridged(hub, nodes)
    finally:
        for node in nodes:
            sh("ip", "netns", "del", node.ns, check=False)
        sh("ip", "netns", "del", hub, check=False)
