"""`/v1/me`, `/v1/tokens`, `/v1/tenants`: who is calling, API tokens and tenant quotas.

Tokens are made and listed by admins (`elastrain token create --tenant T`); a tenant may
list and revoke its own (a leaked token should not wait for an admin). Quotas are admin
business.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, status
from sqlalchemy.orm import Session

from elastrain.api.deps import AdminPrincipal, CurrentPrincipal, SessionDep, SettingsDep, TokenCache
from elastrain.api.schemas import (
    Me,
    TenantName,
    TenantOut,
    TenantQuota,
    TokenCreate,
    TokenCreated,
    TokenOut,
)
from elastrain.service import auth
from elastrain.service.models import Tenant
from elastrain.service.settings import Settings

router = APIRouter(prefix="/v1", tags=["access"])

TokenId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The token's id.")]
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such token"}}


@router.get("/me", response_model=Me, summary="Who the presented token acts for")
def me(who: CurrentPrincipal, settings: SettingsDep) -> Me:
    return Me(tenant=who.tenant, admin=who.admin, auth=settings.auth_enabled)


@router.post(
    "/tokens",
    response_model=TokenCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Create a token for a tenant (admin); the token is in this answer only",
)
def create_token(body: TokenCreate, _: AdminPrincipal, session: SessionDep) -> TokenCreated:
    row, token = auth.create_token(session, tenant=body.tenant, admin=body.admin, name=body.name)
    session.commit()
    return TokenCreated.model_validate(
        {**TokenOut.model_validate(row).model_dump(), "token": token}
    )


@router.get("/tokens", response_model=list[TokenOut], summary="Tokens (an admin sees all)")
def list_tokens(who: CurrentPrincipal, session: SessionDep) -> list[TokenOut]:
    rows = auth.list_tokens(session, tenant=who.owner_filter)
    return [TokenOut.model_validate(row) for row in rows]


@router.delete(
    "/tokens/{token_id}",
    response_model=TokenOut,
    summary="Revoke a token (idempotent); it stops working within seconds",
    responses=_NOT_FOUND,
)
def revoke_token(
    token_id: TokenId, request: Request, who: CurrentPrincipal, session: SessionDep
) -> TokenOut:
    try:
        row = auth.revoke_token(session, token_id, tenant=who.owner_filter)
    except auth.TokenNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=str(exc)) from exc
    session.commit()
    cache: TokenCache = request.app.state.token_cache
    cache.clear()  # this replica at once; the others within the cache's lifetime
    return TokenOut.model_validate(row)


def _tenant_out(session: Session, tenant: Tenant, settings: Settings) -> TenantOut:
    own = tenant.max_workers
    return TenantOut(
        name=tenant.name,
        max_workers=own,
        quota=own if own is not None else settings.default_max_workers_per_tenant,
        workers_in_use=auth.workers_held(session, tenant.name),
    )


@router.get("/tenants", response_model=list[TenantOut], summary="Tenants and quotas (admin)")
def list_tenants(_: AdminPrincipal, session: SessionDep, settings: SettingsDep) -> list[TenantOut]:
    return [_tenant_out(session, t, settings) for t in auth.list_tenants(session)]


@router.put(
    "/tenants/{name}",
    response_model=TenantOut,
    summary="Set a tenant's quota of running workers (admin); creates the tenant if new",
)
def set_quota(
    name: Annotated[TenantName, Path(description="The tenant.")],
    body: TenantQuota,
    _: AdminPrincipal,
    session: SessionDep,
    settings: SettingsDep,
) -> TenantOut:
    tenant = auth.set_quota(session, name, body.max_workers)
    session.commit()
    return _tenant_out(session, tenant, settings)
