"""`/v1/cluster`: the scheduler's latest snapshot of the Ray cluster, from the DB (the API
never asks Ray, and every replica serves the same view)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import CurrentTenant, SessionDep
from service import cluster

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.get("/cluster", summary="Nodes, free resources and where jobs run")
def get_cluster(_: CurrentTenant, session: SessionDep) -> dict[str, Any]:
    return cluster.current(session).to_dict()
