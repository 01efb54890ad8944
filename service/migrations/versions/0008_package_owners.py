"""Packages per tenant: who uploaded each stored package, and whom an admin shared it with.

Packages already referenced by a job are granted to that job's owner, so code that ran
before the upgrade keeps running for the tenant that submitted it (sizes unknown: 0).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    grants = op.create_table(
        "package_owners",
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("tenant", sa.String(length=100), nullable=False),
        sa.Column("uploaded", sa.Boolean(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("granted_by", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", "tenant"),
    )
    jobs = sa.table("jobs", sa.column("owner", sa.String()), sa.column("spec", sa.JSON()))
    seen: set[tuple[str, str]] = set()
    for owner, spec in op.get_bind().execute(sa.select(jobs.c.owner, jobs.c.spec)):
        if isinstance(spec, str):
            spec = json.loads(spec)
        digest = ((spec or {}).get("workload") or {}).get("package")
        if isinstance(digest, str) and digest:
            seen.add((digest, owner))
    now = datetime.now(timezone.utc)
    if seen:
        op.bulk_insert(
            grants,
            [
                {
                    "digest": d,
                    "tenant": t,
                    "uploaded": True,
                    "size_bytes": 0,
                    "granted_by": t,
                    "created_at": now,
                }
                for d, t in sorted(seen)
            ],
        )


def downgrade() -> None:
    op.drop_table("package_owners")
