"""Liveness for load balancers and `docker compose`: open, even when a token is required."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from elastrain.api.deps import SessionDep
from elastrain.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request, session: SessionDep) -> JSONResponse:
    try:
        session.execute(text("SELECT 1"))
        database = "ok"
    except SQLAlchemyError as exc:
        database = f"unavailable: {type(exc).__name__}"
    ok = database == "ok"
    body = Health(
        status="ok" if ok else "degraded",
        database=database,
        scheduler=getattr(request.app.state, "scheduler", None) is not None,
    )
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
