"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`) with the service
on top, so that node loss is real: removing a node kills its raylet and its workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from fastapi.testclient import TestClient
from ray.cluster_utils import Cluster

from elastrain.api.main import create_app
from elastrain.service.settings import Settings


@dataclass
class Nodes:
    cluster: Cluster
    workers: list[Any] = field(default_factory=list)

    def add(self, cpus: int = 1, gpus: int = 0) -> Any:
        """A node with `cpus` CPUs and `gpus` GPUs as Ray resources (declared: on a
        machine without GPUs, with `ELASTRAIN_TEST_GPU_ON_CPU=1` GPU ranks train on CPU)."""
        node = self.cluster.add_node(num_cpus=cpus, num_gpus=gpus)
        self.cluster.wait_for_nodes()
        self.workers.append(node)
        return node

    def remove(self, node: Any) -> None:
        self.workers.remove(node)
        self.cluster.remove_node(node)

    def node_of(self, node_id: str) -> Any:
        return next(n for n in self.workers if n.node_id == node_id)


@contextmanager
def multi_node_service(
    tmp: Path,
    *,
    worker_nodes: int = 3,
    cpus_per_node: int = 1,
    gpus_per_node: int = 0,
    **settings_kw: Any,
) -> Iterator[tuple[TestClient, Nodes]]:
    # The head holds no CPUs: training workers land only on the worker nodes, and the
    # drivers (0 CPU, pinned to the head) survive any worker node's loss.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = Nodes(cluster)
    for _ in range(worker_nodes):
        nodes.add(cpus_per_node, gpus_per_node)
    ray.init(address=cluster.address, namespace="elastrain-chaos")
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'elastrain.db'}",
        storage_path=tmp / "storage",
        ray_address=cluster.address,
        ray_namespace="elastrain-chaos",
        scheduler_interval_s=0.3,
        **settings_kw,
    )
    try:
        with TestClient(create_app(settings, start_scheduler=True)) as client:
            yield client, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@dataclass
class Slowdown:
    """What `slowed` achieved, known once it ended."""

    stopped_share: float | None = None

    @property
    def factor(self) -> float | None:
        """How many times slower the process ran (1 / the share of time it ran)."""
        if self.stopped_share is None or self.stopped_share >= 1:
            return None
        return 1 / (1 - self.stopped_share)


@contextmanager
def slowed(pid: int, period_s: float = 0.004, stopped: float = 0.5) -> Iterator[Slowdown]:
    """A process made about 1 / (1 - stopped) times slower from outside (2x by default),
    finely enough that any piece of its work longer than a few milliseconds takes that
    much longer, as on a slower device (`tests.chaos.slow_down`: a process of its own, at
    a real-time priority where allowed, so the turns hold on a busy machine). The
    yielded `Slowdown` says what was achieved."""
    achieved = Slowdown()
    injector = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.slow_down", str(pid), str(period_s), str(stopped)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        yield achieved
    finally:
        injector.terminate()
        out, _ = injector.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ValueError, KeyError, IndexError):
            achieved.stopped_share = float(
                json.loads(out.strip().splitlines()[-1])["stopped_share"]
            )
