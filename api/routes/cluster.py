"""`/v1/cluster`: the scheduler's latest snapshot of the Ray cluster, from the DB (the API
never asks Ray, and every replica serves the same view)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from api.deps import CurrentPrincipal, SessionDep
from service import cluster
from service.models import Job

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.get("/cluster", summary="Nodes, free resources and where jobs run")
def get_cluster(who: CurrentPrincipal, session: SessionDep) -> dict[str, Any]:
    view = cluster.current(session)
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
