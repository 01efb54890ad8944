"""The cluster as the API and dashboard see it: a snapshot the scheduler keeps in the DB.

The API must not import Ray, and several API replicas (some started `--no-scheduler`) must
all serve the same view, so the scheduler writes a plain snapshot on every pass and every
replica reads it from the database. A snapshot older than `STALE_AFTER_S` means no
scheduler is connected to Ray any more: it is served with `connected: false`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from elastrain.service.capacity import ClusterCapacity, NodeDrain, memory_share
from elastrain.service.models import ClusterSnapshot, as_utc, utcnow

SNAPSHOT_NAME = "ray"
#: Several scheduler passes (and the lease's lifetime) without a fresh snapshot.
STALE_AFTER_S = 15.0


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
    memory_bytes: int = 0  # host memory Ray may give to tasks (0: unknown)
    drain: DrainView | None = None  # going away: nothing new is placed, jobs leave it
    warming: bool = False  # joined; its worker processes still starting (jobs grow onto it after)


@dataclass(frozen=True, kw_only=True)
class DrainView:
    reason: str
    deadline: float | None  # epoch seconds; None: no deadline
    source: str  # admin (elastrain drain), ray (Ray's drain API), preemption (a notice)

    @classmethod
    def of(cls, drain: NodeDrain) -> DrainView:
        return cls(reason=drain.reason, deadline=drain.deadline, source=drain.source.value)


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    connected: bool
    nodes: list[NodeView] = field(default_factory=list)
    dashboard_url: str | None = None
    updated_at: float | None = None  # time.time() of the snapshot

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterView:
        return cls(
            connected=bool(data.get("connected")),
            nodes=[_node_of(n) for n in data.get("nodes", [])],
            dashboard_url=data.get("dashboard_url"),
            updated_at=data.get("updated_at"),
        )


def _node_of(data: Mapping[str, Any]) -> NodeView:
    drain = data.get("drain")
    return NodeView(**{**data, "drain": DrainView(**drain) if drain else None})


def with_drains(view: ClusterView, drains: Mapping[str, NodeDrain]) -> ClusterView:
    """The view with these drains on their nodes (the operators' drains, read at once: a
    drain shows before the scheduler's next snapshot)."""
    if not drains:
        return view
    nodes = [
        replace(n, drain=DrainView.of(drains[n.node_id])) if n.node_id in drains and n.alive else n
        for n in view.nodes
    ]
    return replace(view, nodes=nodes)


def snapshot(
    capacity: ClusterCapacity,
    free: ClusterCapacity,
    placed: Mapping[int, list[str]],
    *,
    draining: Mapping[str, NodeDrain] | None = None,
) -> ClusterView:
    """The view of `capacity` with what is `free` of it, the nodes each job's workers
    are `placed` on (job id -> node of each rank) and the `draining` nodes."""
    draining = draining or {}
    jobs_on: dict[str, set[int]] = {}
    for job_id, nodes in placed.items():
        for node in nodes:
            jobs_on.setdefault(node, set()).add(job_id)
    free_by_id = {n.node_id: n for n in free.nodes}
    views = []
    for n in capacity.nodes:
        left = free_by_id.get(n.node_id)
        views.append(
            NodeView(
                node_id=n.node_id,
                address=n.address,
                alive=n.alive,
                cpus_total=n.cpus,
                cpus_free=max(left.cpus, 0) if left else 0,
                gpus_total=n.gpus,
                gpus_free=max(left.gpus, 0) if left else 0,
                jobs=sorted(jobs_on.get(n.node_id, ())),
                memory_bytes=n.memory_bytes,
                drain=DrainView.of(d) if (d := draining.get(n.node_id)) is not None else None,
                warming=n.warming and n.alive,
            )
        )
    return ClusterView(
        connected=True, nodes=views, dashboard_url=capacity.dashboard_url, updated_at=time.time()
    )


def worker_memory_bytes(view: ClusterView, cpus_per_worker: float) -> int | None:
    """Host memory a CPU worker of this shape can count on (`capacity.memory_share`)."""
    nodes = ((n.memory_bytes, n.cpus_total) for n in view.nodes if n.alive)
    return memory_share(nodes, cpus_per_worker)


def publish(session: Session, view: ClusterView) -> None:
    """Write the snapshot (an upsert: two schedulers racing during a lease hand-over must
    not fail on the primary key)."""
    values = {"name": SNAPSHOT_NAME, "view": view.to_dict(), "updated_at": utcnow()}
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = insert(ClusterSnapshot).values(**values)
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["name"],
            set_={"view": values["view"], "updated_at": values["updated_at"]},
        )
    )


def current(session: Session, *, stale_after_s: float = STALE_AFTER_S) -> ClusterView:
    """The latest snapshot; `connected` is false when there is none or it is stale."""
    row = session.get(ClusterSnapshot, SNAPSHOT_NAME)
    if row is None:
        return ClusterView(connected=False)
    view = ClusterView.from_dict(row.view)
    age = (utcnow() - as_utc(row.updated_at)).total_seconds()
    return replace(view, connected=False) if age > stale_after_s else view
