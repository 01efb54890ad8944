"""A Ray cluster whose worker nodes are real hosts on a network: each in its own Linux
network namespace (iproute2 `ip netns` + a veth pair on a bridge), so that a node can be
partitioned away (its processes live on, cut off), frozen (SIGSTOP) or have its raylet
killed, as happens to machines, not just to processes.

    root namespace: bridge <br> 10.<a>.<b>.1/24 -- Ray head (GCS, 0 CPUs), the service
    namespace <ns>-1: veth 10.<a>.<b>.11/24  -- `ray start --address=...` (a worker node)
    namespace <ns>-2: veth 10.<a>.<b>.12/24  -- ...

Everything it creates carries a random tag, and teardown removes it all: namespaces, links,
and every process of the cluster. It sends traffic only to the addresses it created. Needs
root (CAP_NET_ADMIN), as CI has.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

# The GCS declares a node dead after this many missed health checks, one a second: a
# partition or a freeze is noticed in about 3-5 s instead of Ray's default ~30 s.
HEALTH_CHECK_ENV = {
    # Ray's own token auth (off by default, on when a token is configured for this user) is
    # not what these tests are about: one setting for every node, stated.
    "RAY_AUTH_MODE": "disabled",
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
_BIN = Path(sys.executable).parent


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=120)


@dataclass
class Node:
    name: str  # the namespace
    index: int
    ip: str
    host_link: str  # the bridge side of its veth pair (down = partitioned)
    cpus: int
    node_id: str | None = None
    starts: int = 0

    def pids(self) -> list[int]:
        out = _run("ip", "netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def raylet_pids(self) -> list[int]:
        return [p for p in self.pids() if _comm(p) == "raylet"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class NetnsCluster:
    tmp: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[Node] = field(default_factory=list)
    subnet: str = field(
        default_factory=lambda: f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    )
    port: int = 0
    added: int = 0

    @property
    def bridge(self) -> str:
        return f"elb{self.tag}"

    @property
    def head_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    @property
    def temp_dir(self) -> str:
        # Short: Ray's unix sockets live under it (108-byte limit on a socket path).
        return f"/tmp/elx{self.tag}"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, node_cpus: list[int]) -> NetnsCluster:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.port = _free_port(self.head_ip)
        env = {**os.environ, **HEALTH_CHECK_ENV}
        head = subprocess.run(
            [str(_BIN / "ray"), "start", "--head", f"--node-ip-address={self.head_ip}",
             f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={self.temp_dir}"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if head.returncode != 0:
            raise RuntimeError(f"ray start --head failed:\n{head.stderr[-3000:]}")
        for cpus in node_cpus:
            self.add_node(cpus)
        return self

    def add_node(self, cpus: int) -> Node:
        self.added += 1
        index = self.added
        node = Node(
            name=f"eln{self.tag}-{index}",
            index=index,
            ip=f"{self.subnet}.{10 + index}",
            host_link=f"elv{self.tag}{index}",
            cpus=cpus,
        )
        peer = f"elp{self.tag}{index}"
        _run("ip", "netns", "add", node.name)
        _run("ip", "link", "add", node.host_link, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", node.host_link, "master", self.bridge)
        _run("ip", "link", "set", node.host_link, "up")
        _run("ip", "link", "set", peer, "netns", node.name)
        _run("ip", "netns", "exec", node.name, "ip", "addr", "add", f"{node.ip}/24", "dev", peer)
        _run("ip", "netns", "exec", node.name, "ip", "link", "set", peer, "up")
        _run("ip", "netns", "exec", node.name, "ip", "link", "set", "lo", "up")
        self.nodes.append(node)
        self.start_raylet(node)
        return node

    def start_raylet(self, node: Node) -> str | None:
        """(Re)start the node's Ray processes: a new raylet, a new Ray node id. (Ray never
        lets a node it declared dead come back with its old raylet; a supervisor such as
        KubeRay or systemd starts a new one, as this does.)"""
        for pid in node.pids():  # leftovers of its previous life
            _kill(pid, signal.SIGKILL)
        before = {n["NodeID"] for n in ray.nodes()} if ray.is_initialized() else set()
        # Started one at a time: two raylets starting at once on one machine can pick the
        # same socket name under the shared temp dir.
        started = subprocess.run(
            ["env", *(f"{k}={v}" for k, v in HEALTH_CHECK_ENV.items()),
             "ip", "netns", "exec", node.name, str(_BIN / "ray"), "start",
             f"--address={self.address}", f"--node-ip-address={node.ip}",
             f"--num-cpus={node.cpus}", "--disable-usage-stats"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if started.returncode != 0:
            raise RuntimeError(f"ray start on {node.name} failed:\n{started.stderr[-3000:]}")
        node.starts += 1
        node.node_id = self._wait_node_id(node.ip, exclude=before)
        return node.node_id

    def _wait_node_id(self, ip: str, *, exclude: set[str]) -> str | None:
        if not ray.is_initialized():
            return None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for n in ray.nodes():
                if n["Alive"] and n["NodeManagerAddress"] == ip and n["NodeID"] not in exclude:
                    node_id: str = n["NodeID"]
                    return node_id
            time.sleep(0.2)
        raise AssertionError(f"node {ip} did not join the cluster")

    def identify_nodes(self) -> None:
        """Once this process is connected to Ray: learn each node's Ray id."""
        for node in self.nodes:
            node.node_id = self._wait_node_id(node.ip, exclude=set())

    def node_by_id(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)

    # -- faults ---------------------------------------------------------------------------

    def partition(self, node: Node) -> None:
        """Cut the node off the network. Its processes keep running and keep trying."""
        _run("ip", "link", "set", node.host_link, "down")

    def heal(self, node: Node) -> None:
        _run("ip", "link", "set", node.host_link, "up")

    def freeze(self, node: Node) -> None:
        """SIGSTOP every process on the node (its raylet and workers): a hung machine."""
        for pid in node.pids():
            _kill(pid, signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        for pid in node.pids():
            _kill(pid, signal.SIGCONT)

    def kill_raylet(self, node: Node) -> None:
        pids = node.raylet_pids()
        assert pids, f"no raylet on {node.name}"
        for pid in pids:
            _kill(pid, signal.SIGKILL)

    def wait_dead(self, node: Node, timeout: float = 60) -> float:
        """Seconds until Ray's GCS declares the node dead."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if node.node_id not in alive:
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"{node.name} was never declared dead")

    def remove_node(self, node: Node) -> None:
        """Take the node away for good: its processes, its namespace, its link."""
        for pid in node.pids():
            _kill(pid, signal.SIGCONT)
            _kill(pid, signal.SIGKILL)
        _run("ip", "netns", "del", node.name, check=False)
        _run("ip", "link", "del", node.host_link, check=False)
        self.nodes.remove(node)

    # -- teardown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        for node in self.nodes:
            for pid in node.pids():
                _kill(pid, signal.SIGCONT)
                _kill(pid, signal.SIGKILL)
        for pid in _pids_mentioning(self.temp_dir):
            _kill(pid, signal.SIGKILL)
        for node in self.nodes:
            _run("ip", "netns", "del", node.name, check=False)
            _run("ip", "link", "del", node.host_link, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        if not os.environ.get("ELASTRAIN_KEEP_RAY_LOGS"):  # set it to read Ray's logs after
            subprocess.run(["rm", "-rf", self.temp_dir], check=False)


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text` (the head's processes name its temp
    dir); never this one."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
