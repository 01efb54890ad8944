"""Request dependencies: the DB session, the settings and the calling tenant."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.settings import Settings

# The dependencies are `async def` although they do no I/O of their own: FastAPI runs a
# plain `def` dependency in the threadpool, and those hops were a measurable share of a
# request's cost (see docs/bench-api.md). Routes stay `def`: their DB work runs in a thread.


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session per request. Routes commit what they change; anything left is rolled back.

    Making a session does no I/O (it connects on first use), so it is made on the event
    loop; closing one that still holds a connection does (a rollback), so that goes to a
    thread.
    """
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": the session is closed (its connection back in the pool) before the
# response is sent, not after, so a slow client never holds a DB connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

DEFAULT_TENANT = "default"


async def get_tenant(request: Request, settings: SettingsDep) -> str:
    """The owner of what this request creates and sees.

    Without `api_token` everything belongs to the "default" tenant. With it, every request
    must carry `Authorization: Bearer <token>`. Per-tenant tokens can map to owners here
    later without touching the routes or the data.
    """
    if settings.api_token:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), settings.api_token.encode()
        ):
            raise HTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED,
                detail="missing or invalid API token: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return DEFAULT_TENANT


CurrentTenant = Annotated[str, Depends(get_tenant)]
