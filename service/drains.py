"""Drained nodes: what operators drained (stored, `elastrain drain`) and what Ray reports
draining (its drain API: the autoscaler, KubeRay scale-down, a preemption notice), merged
into the one view the scheduler decides on. A draining node is alive (its ranks are not
lost) but is capacity going away: nothing new is placed on it (`capacity._fit`) and jobs
leave it (`decisions._on_drain`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from elastrain.contracts.spec import FailureSpec, StragglerAction
from elastrain.service.capacity import ClusterCapacity, DrainSource, NodeDrain
from elastrain.service.models import NodeDrainRow, as_utc


def stored(session: Session) -> list[NodeDrain]:
    """The operators' drains, oldest first."""
    rows = session.scalars(select(NodeDrainRow).order_by(NodeDrainRow.created_at)).all()
    return [as_drain(row) for row in rows]


def as_drain(row: NodeDrainRow) -> NodeDrain:
    deadline = as_utc(row.deadline).timestamp() if row.deadline is not None else None
    return NodeDrain(
        node_id=row.node_id, reason=row.reason, deadline=deadline, source=DrainSource.ADMIN
    )


def drain(
    session: Session, *, node_id: str, reason: str, deadline: float | None, by: str
) -> NodeDrainRow:
    """Drain a node (again: the new reason and deadline replace the old ones)."""
    when = datetime.fromtimestamp(deadline, timezone.utc) if deadline is not None else None
    row = session.get(NodeDrainRow, node_id, with_for_update=True)
    if row is None:
        row = NodeDrainRow(node_id=node_id, reason=reason, deadline=when, created_by=by)
        session.add(row)
    else:
        row.reason, row.deadline, row.created_by = reason, when, by
    session.flush()
    return row


def undrain(session: Session, node_id: str) -> bool:
    """Give the node back; False when it was not drained here."""
    row = session.get(NodeDrainRow, node_id, with_for_update=True)
    if row is None:
        return False
    session.delete(row)
    return True


def effective(
    capacity: ClusterCapacity, admin: Iterable[NodeDrain]
) -> tuple[ClusterCapacity, dict[str, NodeDrain]]:
    """The capacity with every draining node marked (its workers no longer fit), and the
    drains by node id: the operators' and Ray's (`capacity.drains`). A node drained both
    ways keeps the operator's reason and the earlier deadline. Drains of nodes that are
    not alive are left out: their jobs' ranks are lost, not leaving."""
    alive = capacity.alive_ids()
    merged: dict[str, NodeDrain] = {}
    for drain_ in (*capacity.drains, *admin):
        if drain_.node_id not in alive:
            continue
        known = merged.get(drain_.node_id)
        merged[drain_.node_id] = drain_ if known is None else _both(known, drain_)
    if not merged:
        return capacity, {}
    nodes = tuple(
        replace(n, draining=True) if n.node_id in merged and not n.draining else n
        for n in capacity.nodes
    )
    return replace(capacity, nodes=nodes), merged


def _both(ray_: NodeDrain, admin: NodeDrain) -> NodeDrain:
    deadlines = [d for d in (ray_.deadline, admin.deadline) if d is not None]
    return replace(admin, deadline=min(deadlines) if deadlines else None)


def resolve(node_id: str, known: Sequence[str]) -> str | list[str]:
    """The full id of the node `node_id` names, exactly or by a unique prefix of at least
    6 characters (what `elastrain cluster` and the dashboard show); else the candidates
    (none: unknown, several: ambiguous)."""
    if node_id in known:
        return node_id
    matches = [n for n in known if len(node_id) >= 6 and n.startswith(node_id)]
    return matches[0] if len(matches) == 1 else matches


def keep_off(
    failure: FailureSpec, slow_nodes: Iterable[str], kept: Mapping[str, float], *, now: float
) -> dict[str, float]:
    """The nodes a job keeps off now, each until when: those whose cooldown still runs,
    and, when the job evicts stragglers, the nodes of its stragglers now (from now on for
    `failure.straggler_cooldown_s`). Pure."""
    still = {node: until for node, until in kept.items() if until > now}
    if failure.stragglers != StragglerAction.evict:
        return still
    until = now + failure.straggler_cooldown_s
    return {**{node: until for node in slow_nodes}, **still}


def kept_off_drains(kept: Mapping[str, float]) -> list[NodeDrain]:
    """The nodes one job keeps off, as drains of that job's own: it leaves them at a step
    boundary (state in memory, no restart counted) and is placed elsewhere until then."""
    return [
        NodeDrain(
            node_id=node,
            reason=f"a straggler ran there: kept off until {_clock(until)}",
            source=DrainSource.STRAGGLER,
        )
        for node, until in sorted(kept.items())
    ]


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%H:%M:%S UTC")
