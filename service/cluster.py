"""A view of the Ray cluster for the API and dashboard, kept by the scheduler.

The API must not import Ray, so the scheduler (which talks to Ray through the launcher)
publishes a plain snapshot here on every pass and the API reads it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class NodeView:
    node_id: str
    address: str
    alive: bool
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float
    jobs: list[int] = field(default_factory=list)  # job ids with workers on this node


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    connected: bool
    nodes: list[NodeView] = field(default_factory=list)
    dashboard_url: str | None = None
    updated_at: float | None = None  # time.time() of the snapshot

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_lock = threading.Lock()
_current = ClusterView(connected=False)


def publish(view: ClusterView) -> None:
    global _current
    with _lock:
        _current = view


def current() -> ClusterView:
    with _lock:
        return _current
