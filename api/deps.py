"""Request dependencies: the DB session, the settings and who is calling."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from elastrain.service import auth
from elastrain.service.auth import Principal
from elastrain.service.logs import set_context
from elastrain.service.settings import Settings

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


class TokenCache:
    """Resolved tokens for a few seconds: a request costs no extra query, and a revoked
    token stops working within `ttl_s` on every API replica."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Principal | None]] = {}

    def get(self, digest: str) -> tuple[bool, Principal | None]:
        hit = self._entries.get(digest)
        if hit is None or hit[0] < time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, digest: str, principal: Principal | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # a flood of made-up tokens must not grow memory
        self._entries[digest] = (time.monotonic() + self.ttl_s, principal)

    def clear(self) -> None:
        self._entries.clear()


# Declares the scheme in OpenAPI; auto_error=False: the 401 and its message are ours.
_bearer = HTTPBearer(auto_error=False, description="A token from `elastrain token create`.")


def _unauthorized(why: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=f"{why}: send 'Authorization: Bearer <token>'",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _lookup(request: Request, token: str) -> Principal | None:
    digest = auth.hash_token(token)
    cache: TokenCache = request.app.state.token_cache
    hit, principal = cache.get(digest)
    if not hit:
        with request.app.state.session_factory() as session:
            principal = auth.resolve(session, token)
        cache.put(digest, principal)
    return principal


async def get_principal(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Who the request acts for.

    Authentication off (no ELASTRAIN_API_TOKEN, ELASTRAIN_AUTH unset): one user, allowed
    everything, on loopback only (`elastrain serve` refuses otherwise). On: the operator's
    token is an admin of the "default" tenant; any other must be a live token from the DB.
    """
    if not settings.auth_enabled:
        return auth.ANONYMOUS
    if credentials is None:
        raise _unauthorized("an API token is required")
    token = credentials.credentials.strip()
    admin_token = settings.api_token
    if admin_token is not None and secrets.compare_digest(
        token.encode(), admin_token.get_secret_value().encode()
    ):
        set_context(tenant=auth.DEFAULT_TENANT)
        return auth.Principal(auth.DEFAULT_TENANT, admin=True)
    if not token.startswith(auth.TOKEN_PREFIX) or len(token) > 200:
        raise _unauthorized("invalid API token")
    principal = await run_in_threadpool(_lookup, request, token)
    if principal is None:
        raise _unauthorized("invalid or revoked API token")
    set_context(tenant=principal.tenant)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


async def require_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.admin:
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN, detail="this needs an admin token"
        )
    return principal


AdminPrincipal = Annotated[Principal, Depends(require_admin)]
