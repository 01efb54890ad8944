"""`/metrics`: Prometheus exposition (see `service/telemetry.py` for what is in it).

It names every tenant's jobs, so with authentication on it needs an admin token: give
Prometheus one of its own (`elastrain token create --tenant prometheus --admin`) as its
scrape config's `authorization: {credentials: ...}`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from elastrain.api.deps import AdminPrincipal
from elastrain.service import telemetry

router = APIRouter(tags=["operations"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (admin)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request, _: AdminPrincipal) -> Response:
    body = await run_in_threadpool(telemetry.exposition, request.app.state.session_factory)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
