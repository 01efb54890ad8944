"""Tenants and API tokens: who a request acts for, and what that lets it see.

A token is the right to run code on the cluster (a job's workload is code), so tokens are
made by admins, shown once, stored only as their SHA-256, and revocable. A `Principal` is
what a token resolves to: a tenant, and whether it is an admin (sees and acts on every
tenant's jobs and manages tokens). Functions take a `Session` and never commit.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from elastrain.service.models import ApiToken, Job, Tenant, utcnow
from elastrain.service.states import ACTIVE

#: Tokens start with this, so a leaked one is recognisable (secret scanners, logs).
TOKEN_PREFIX = "elt_"
#: The tenant of everything when authentication is off, and of the operator's admin token.
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    admin: bool = False

    def sees(self, owner: str) -> bool:
        """May this caller see (and act on) a job of `owner`?"""
        return self.admin or owner == self.tenant

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict queries to (None: every tenant's)."""
        return None if self.admin else self.tenant


#: Who a request acts for when authentication is off: one user, who may do everything.
ANONYMOUS = Principal(DEFAULT_TENANT, admin=True)


class TokenNotFound(LookupError):
    def __init__(self, token_id: int) -> None:
        super().__init__(f"token {token_id} not found")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def ensure_tenant(session: Session, name: str) -> Tenant:
    tenant = session.get(Tenant, name)
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_token(
    session: Session, *, tenant: str, admin: bool = False, name: str = ""
) -> tuple[ApiToken, str]:
    """A new token for `tenant` (created if new). Returns the row and the token itself,
    which is never stored and cannot be shown again."""
    ensure_tenant(session, tenant)
    token = new_token()
    row = ApiToken(
        tenant=tenant, admin=admin, name=name, prefix=token[:12], sha256=hash_token(token)
    )
    session.add(row)
    session.flush()
    return row, token


def resolve(session: Session, token: str) -> Principal | None:
    """The principal of a live (unrevoked) token, or None."""
    row = session.execute(
        select(ApiToken.tenant, ApiToken.admin).where(
            ApiToken.sha256 == hash_token(token), ApiToken.revoked_at.is_(None)
        )
    ).one_or_none()
    return Principal(row.tenant, admin=row.admin) if row is not None else None


def list_tokens(session: Session, *, tenant: str | None = None) -> Sequence[ApiToken]:
    stmt = select(ApiToken).order_by(ApiToken.id)
    if tenant is not None:
        stmt = stmt.where(ApiToken.tenant == tenant)
    return session.scalars(stmt).all()


def revoke_token(session: Session, token_id: int, *, tenant: str | None = None) -> ApiToken:
    """Revoke (idempotently). `tenant`: only if it is that tenant's token."""
    row = session.get(ApiToken, token_id)
    if row is None or (tenant is not None and row.tenant != tenant):
        raise TokenNotFound(token_id)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def list_tenants(session: Session) -> Sequence[Tenant]:
    return session.scalars(select(Tenant).order_by(Tenant.name)).all()


def set_quota(session: Session, name: str, max_workers: int | None) -> Tenant:
    tenant = ensure_tenant(session, name)
    tenant.max_workers = max_workers
    return tenant


def quotas(session: Session) -> dict[str, int | None]:
    """Each tenant's own quota (None: the default applies)."""
    return {
        row.name: row.max_workers
        for row in session.execute(select(Tenant.name, Tenant.max_workers))
    }


def workers_held(session: Session, tenant: str) -> int:
    """Workers the tenant's active jobs hold now (for `GET /v1/tenants`)."""
    held = session.scalar(
        select(func.coalesce(func.sum(Job.world_size), 0)).where(
            Job.owner == tenant, Job.state.in_(list(ACTIVE))
        )
    )
    return int(held or 0)
