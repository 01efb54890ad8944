"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`) with the service
on top, so that node loss is real: removing a node kills its raylet and its workers."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
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


@contextmanager
def slowed(pid: int, period_s: float = 0.004) -> Iterator[None]:
    """A process made about 2x slower from outside: stopped and resumed in turns, half
    of every `period_s` stopped (as `cpulimit` does), finely enough that any piece of its
    work longer than a few milliseconds takes about twice as long, as on a slower device.
    Stopped relative to itself, so the slowdown holds however busy the machine is."""
    done = threading.Event()

    def cycle() -> None:
        with contextlib.suppress(ProcessLookupError):
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(period_s / 2)
                os.kill(pid, signal.SIGCONT)
                time.sleep(period_s / 2)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
