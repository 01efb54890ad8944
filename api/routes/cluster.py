"""`/v1/cluster`: the scheduler's latest snapshot of the Ray cluster (the API never asks Ray)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import CurrentTenant
from service import cluster

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.get("/cluster", summary="Nodes, free resources and where jobs run")
def get_cluster(_: CurrentTenant) -> dict[str, Any]:
    return cluster.current().to_dict()
