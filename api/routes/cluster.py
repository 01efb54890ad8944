"""`/v1/cluster`: the scheduler's latest snapshot of the Ray cluster, from the DB (the API
never asks Ray, and every replica serves the same view), and the operators' drains.

A drained node is capacity going away: no rank is placed there and every job leaves it at
a step boundary (service/decisions.py). Drains are stored, so they outlive a control-plane
restart; drains Ray reports (autoscaler, KubeRay, preemption notices) show in the snapshot.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from sqlalchemy import select

from elastrain.api.deps import AdminPrincipal, CurrentPrincipal, SessionDep
from elastrain.api.errors import Conflict
from elastrain.api.schemas import DrainRequest, NodeDrainOut
from elastrain.service import cluster, drains
from elastrain.service.models import Job, NodeDrainRow

router = APIRouter(prefix="/v1", tags=["cluster"])

#: A Ray node id (56 hex digits), or a prefix of one of at least 6 (what the CLI and the
#: dashboard show).
NodeId = Annotated[
    str,
    Path(
        pattern=r"^[0-9a-f]{6,64}$",
        description="The node's Ray id, or a unique prefix of it (at least 6 hex digits).",
    ),
]


@router.get("/cluster", summary="Nodes, free resources, drains and where jobs run")
def get_cluster(who: CurrentPrincipal, session: SessionDep) -> dict[str, Any]:
    view = cluster.current(session)
    # The operators' drains at once, before the scheduler's next snapshot shows them.
    view = cluster.with_drains(view, {d.node_id: d for d in drains.stored(session)})
    if not who.admin:
        # Capacity is everyone's business; which jobs run where is each tenant's own.
        listed = {job for node in view.nodes for job in node.jobs}
        own = set(
            session.scalars(select(Job.id).where(Job.id.in_(listed), Job.owner == who.tenant))
        )
        view = replace(
            view, nodes=[replace(n, jobs=[j for j in n.jobs if j in own]) for n in view.nodes]
        )
    return view.to_dict()


@router.post(
    "/cluster/nodes/{node_id}/drain",
    response_model=NodeDrainOut,
    summary="Drain a node (admin): jobs leave it at a step boundary, nothing new lands there",
)
def drain_node(
    node_id: NodeId, who: AdminPrincipal, session: SessionDep, body: DrainRequest | None = None
) -> NodeDrainOut:
    body = body or DrainRequest()
    full = _known_node(session, node_id)
    deadline = time.time() + body.deadline_s if body.deadline_s is not None else None
    row = drains.drain(session, node_id=full, reason=body.reason, deadline=deadline, by=who.tenant)
    out = _out(row)
    session.commit()
    return out


@router.post(
    "/cluster/nodes/{node_id}/undrain",
    response_model=NodeDrainOut,
    summary="Undrain a node (admin): its capacity is back, jobs may grow onto it",
)
def undrain_node(node_id: NodeId, _: AdminPrincipal, session: SessionDep) -> NodeDrainOut:
    full = _drained_node(session, node_id)
    row = session.get(NodeDrainRow, full)
    if row is None:
        raise _not_drained(session, full)
    out = _out(row)
    drains.undrain(session, full)
    session.commit()
    return out


@router.delete(
    "/cluster/nodes/{node_id}/drain",
    response_model=NodeDrainOut,
    summary="Undrain a node (admin); the same as POST .../undrain",
)
def delete_drain(node_id: NodeId, who: AdminPrincipal, session: SessionDep) -> NodeDrainOut:
    return undrain_node(node_id, who, session)


def _known_node(session: SessionDep, node_id: str) -> str:
    """The full id of an alive node the latest snapshot lists, or a 404/422 that says why."""
    view = cluster.current(session)
    alive = [n.node_id for n in view.nodes if n.alive]
    found = drains.resolve(node_id, alive)
    if isinstance(found, str):
        return found
    if found:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=f"node_id {node_id!r} matches {len(found)} nodes: give more of its digits",
        )
    listed = "" if view.nodes else " (no cluster snapshot yet: is a scheduler running?)"
    raise HTTPException(
        status.HTTP_404_NOT_FOUND,
        detail=f"node {node_id} is not an alive node of the cluster{listed}; "
        "`elastrain cluster` lists them",
    )


def _drained_node(session: SessionDep, node_id: str) -> str:
    """The full id of a drained node (by its stored drain, else as `_known_node`)."""
    stored = list(session.scalars(select(NodeDrainRow.node_id)))
    found = drains.resolve(node_id, stored)
    return found if isinstance(found, str) else _known_node(session, node_id)


def _not_drained(session: SessionDep, node_id: str) -> Exception:
    node = next((n for n in cluster.current(session).nodes if n.node_id == node_id), None)
    if node is not None and node.drain is not None:
        return Conflict(
            f"node {node_id[:12]} is drained by {node.drain.source}, not by elastrain: "
            "it comes back when that drain ends"
        )
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"node {node_id[:12]} is not drained")


def _out(row: NodeDrainRow) -> NodeDrainOut:
    deadline = row.deadline
    if deadline is not None and deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=timezone.utc)
    return NodeDrainOut(
        node_id=row.node_id,
        reason=row.reason,
        deadline=deadline,
        source="admin",
        created_by=row.created_by,
        created_at=row.created_at or datetime.now(timezone.utc),
    )
