"""A DB lease so that at most one scheduler acts on a database at a time.

Several control-plane replicas may run; only the lease holder schedules. The lease is a
single row renewed on every pass; a holder that dies stops renewing and another replica
takes over once it expires. Admission additionally re-checks each job's state under a row
lock (see `Scheduler`), so even two holders during a clock hiccup never launch a job twice.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.models import SchedulerLease, as_utc, utcnow

LEASE_NAME = "scheduler"


def try_acquire(
    factory: sessionmaker[Session], *, holder: str, ttl_s: float, now: datetime | None = None
) -> bool:
    """Take or renew the lease; True when `holder` holds it afterwards."""
    now = now or utcnow()
    with factory() as session:
        try:
            row = session.scalars(
                select(SchedulerLease).where(SchedulerLease.name == LEASE_NAME).with_for_update()
            ).one_or_none()
            if row is None:
                session.add(
                    SchedulerLease(
                        name=LEASE_NAME, holder=holder, expires_at=now + timedelta(seconds=ttl_s)
                    )
                )
            elif row.holder == holder or as_utc(row.expires_at) <= now:
                row.holder = holder
                row.expires_at = now + timedelta(seconds=ttl_s)
            else:
                session.rollback()
                return False
            session.commit()
            return True
        except IntegrityError:  # another replica inserted the row first
            session.rollback()
            return False


def release(factory: sessionmaker[Session], *, holder: str) -> None:
    with factory() as session:
        row = session.get(SchedulerLease, LEASE_NAME, with_for_update=True)
        if row is not None and row.holder == holder:
            session.delete(row)
        session.commit()
