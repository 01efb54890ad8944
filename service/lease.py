"""A DB lease so that at most one scheduler acts on a database at a time.

Several control-plane replicas may run; only the lease holder schedules. The lease is a
single row, renewed by its holder once a third of its time has passed (`LeaseKeeper`); a
holder that dies stops renewing and another replica takes over once it expires, or at once
when the holder was a process of this host that no longer exists (`holder_gone`: a service
restarted by its supervisor after a crash need not wait out the TTL to schedule and store
reports again). Admission additionally re-checks each job's state under a row lock (see
`Scheduler`), so even two holders during a clock hiccup never launch a job twice.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from elastrain.service.models import SchedulerLease, as_utc, utcnow

LEASE_NAME = "scheduler"


def holder_name() -> str:
    """This process's name as a holder: host, pid and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def holder_gone(
    holder: str, *, host: str | None = None, alive: Callable[[int], bool] = _pid_alive
) -> bool:
    """Whether `holder` (`holder_name`'s form) was a process of this host that no longer
    exists. Anything else (another host, a name of another form, a live pid, which may be
    a reused one) is not known gone: its lease runs out by its TTL."""
    parts = holder.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    return parts[0] == (host or socket.gethostname()) and not alive(int(parts[1]))


def try_acquire(
    factory: sessionmaker[Session],
    *,
    holder: str,
    ttl_s: float,
    now: datetime | None = None,
    gone: Callable[[str], bool] = holder_gone,
) -> bool:
    """Take or renew the lease; True when `holder` holds it afterwards. Another holder's
    row is taken once it expired, or at once when that holder is `gone`."""
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
            elif row.holder == holder or as_utc(row.expires_at) <= now or gone(row.holder):
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


class LeaseKeeper:
    """One scheduler's hold on the lease. It renews the row only once a third of the TTL
    has passed since the last renewal, not on every pass: a write transaction every
    half-second pass was a fifth of an idle pass's CPU, on the cores jobs train on. Between
    renewals the row still has at least two thirds of its TTL to run, so no other replica
    can take it; a lost renewal (another holder, a database error) is noticed at the next
    renewal, as before at the next pass."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        holder: str,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factory = factory
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self._renew_at = -math.inf
        self._expires_at = -math.inf
        #: How many times the hold began anew (first taken, or taken again after it was lost
        #: or may have lapsed): another scheduler may have written in between, so whatever
        #: this one remembers of the database must be read again.
        self.tenure = 0

    def hold(self) -> bool:
        """True while this scheduler holds the lease (renewed in the database when due)."""
        started = self.clock()
        if started < self._renew_at:
            return True
        self._renew_at = -math.inf  # an error below leaves it so: asked again next time
        # Not held until now without a break: past the row's expiry, even a row still ours
        # may have been another scheduler's meanwhile.
        lapsed = started >= self._expires_at
        self._expires_at = -math.inf
        if not try_acquire(self.factory, holder=self.holder, ttl_s=self.ttl_s):
            return False
        if lapsed:
            self.tenure += 1
        # Counted from before the renewal: the row expires no earlier than started + ttl.
        self._renew_at = started + self.ttl_s / 3
        self._expires_at = started + self.ttl_s
        return True

    def held_now(self) -> bool:
        """Whether the hold taken by the last `hold()` has not run out, without touching the
        database: for other threads of this scheduler's process (the tracking forwarder),
        which must not renew it themselves."""
        return self.clock() < self._expires_at

    def release(self) -> None:
        self._renew_at = self._expires_at = -math.inf
        release(self.factory, holder=self.holder)
