"""Who may see and use a stored package, and how much each tenant stores. DB only.

The files live once per content digest (`elastrain.service.packages`); these rows say who may name
that digest: the tenant that uploaded it, or one an admin shared it with (`EVERYONE` for
all tenants). A tenant without a row is told the package does not exist, the same answer
as for a digest nobody uploaded, so it learns nothing of other tenants' code. An upload's
bytes count against the uploading tenant's storage quota, once per tenant per package
(two tenants uploading the same content are each charged: each could delete its own).
Functions take a `Session` and never commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from elastrain.service.auth import Principal
from elastrain.service.models import PackageGrant

#: A share with every tenant.
EVERYONE = "*"


def visible(session: Session, digest: str, who: Principal) -> bool:
    """May `who` see and run the package? Admins see every stored package."""
    if who.admin:
        return True
    found = session.scalar(
        select(PackageGrant.tenant)
        .where(
            PackageGrant.digest == digest,
            or_(PackageGrant.tenant == who.tenant, PackageGrant.tenant == EVERYONE),
        )
        .limit(1)
    )
    return found is not None


def uploaded_bytes(session: Session, tenant: str) -> int:
    """What the tenant's uploads take (what its storage quota counts)."""
    used = session.scalar(
        select(func.coalesce(func.sum(PackageGrant.size_bytes), 0)).where(
            PackageGrant.tenant == tenant, PackageGrant.uploaded.is_(True)
        )
    )
    return int(used or 0)


def record_upload(session: Session, digest: str, tenant: str, size_bytes: int) -> bool:
    """The tenant uploaded the package: it may use it from now on. False when it had
    uploaded it before (nothing changes). A share it held becomes its own upload."""
    row = session.get(PackageGrant, (digest, tenant))
    if row is not None and row.uploaded:
        return False
    if row is None:
        row = PackageGrant(digest=digest, tenant=tenant)
        session.add(row)
    row.uploaded, row.size_bytes, row.granted_by = True, size_bytes, tenant
    session.flush()
    return True


def share(session: Session, digest: str, tenant: str, *, by: str) -> None:
    """An admin lets `tenant` (or `EVERYONE`) use the package (idempotent; an upload of
    the tenant's own stays one)."""
    if session.get(PackageGrant, (digest, tenant)) is None:
        session.add(PackageGrant(digest=digest, tenant=tenant, uploaded=False, granted_by=by))
        session.flush()


def unshare(session: Session, digest: str, tenant: str) -> bool:
    """Withdraw a share (not an upload: that is the tenant's own). True if one went."""
    result = session.execute(
        delete(PackageGrant).where(
            PackageGrant.digest == digest,
            PackageGrant.tenant == tenant,
            PackageGrant.uploaded.is_(False),
        )
    )
    return bool(getattr(result, "rowcount", 0))


def grants(session: Session, digest: str) -> Sequence[PackageGrant]:
    return session.scalars(
        select(PackageGrant).where(PackageGrant.digest == digest).order_by(PackageGrant.tenant)
    ).all()


def forget(session: Session, digests: Iterable[str]) -> None:
    """The packages were deleted from storage: nobody holds them any more."""
    gone = list(digests)
    for start in range(0, len(gone), 500):
        session.execute(
            delete(PackageGrant).where(PackageGrant.digest.in_(gone[start : start + 500]))
        )
