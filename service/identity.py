"""Which database this is: the random id its schema was made with (migration 0006)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from elastrain.service.models import DatabaseIdentity


def database_id(session: Session) -> str:
    value = session.scalar(
        select(DatabaseIdentity.value).where(DatabaseIdentity.name == "database")
    )
    if value is None:
        raise RuntimeError(
            "the database has no identity: run the migrations (elastrain serve does)"
        )
    return value
