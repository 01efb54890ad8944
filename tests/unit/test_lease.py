"""The scheduler lease: held by one scheduler at a time, renewed in the database only once a
third of its time has passed (not on every pass), handed over on release."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from elastrain.service import lease
from elastrain.service.db import make_engine, make_session_factory, migrate
from elastrain.service.models import SchedulerLease


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_renewed_once_a_third_of_its_time_has_passed_and_exclusive(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    factory = make_session_factory(engine)

    def expires_at() -> object:
        with factory() as s:
            return s.scalars(select(SchedulerLease.expires_at)).one()

    clock = Clock()
    a = lease.LeaseKeeper(factory, holder="a", ttl_s=30.0, clock=clock)
    b = lease.LeaseKeeper(factory, holder="b", ttl_s=30.0, clock=clock)
    assert a.hold()
    first = expires_at()
    clock.now += 9.9  # passes within a third of the TTL: no write
    assert a.hold()
    assert expires_at() == first
    assert not b.hold()  # the row is a's and has not expired
    clock.now += 0.2
    assert a.hold()
    assert expires_at() > first  # type: ignore[operator]
    a.release()
    assert b.hold()
    clock.now += 100
    assert not a.hold()  # b renews it


def test_a_new_tenure_whenever_the_hold_may_have_lapsed(tmp_path: Path) -> None:
    """`tenure` changes when the lease is first taken and whenever it is taken again after
    it was lost or may have expired (another scheduler may have acted in between), not
    when it is renewed in time."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    factory = make_session_factory(engine)
    clock = Clock()
    a = lease.LeaseKeeper(factory, holder="a", ttl_s=30.0, clock=clock)
    b = lease.LeaseKeeper(factory, holder="b", ttl_s=30.0, clock=clock)
    assert a.hold() and a.tenure == 1
    for _ in range(5):  # renewed (in the database every third pass) before it expires
        clock.now += 5
        assert a.hold() and a.tenure == 1
    clock.now += 31  # past its expiry: the row is still a's, but was it all along?
    assert a.hold() and a.tenure == 2
    a.release()
    assert b.hold()
    clock.now += 100
    assert not a.hold()  # b renews it
    b.release()
    assert a.hold() and a.tenure == 3


@pytest.mark.parametrize(
    ("holder", "alive_pids", "gone"),
    [
        ("here:123:ab12", set(), True),  # this host, its process no longer exists
        ("here:123:ab12", {123}, False),  # alive (or the pid reused): its TTL decides
        ("there:123:ab12", set(), False),  # another host: nothing known of its processes
        ("a", set(), False),  # a name of another form
        ("here:x:ab12", set(), False),
    ],
)  # fmt: skip
def test_a_holder_is_gone_only_when_its_process_on_this_host_is(
    holder: str, alive_pids: set[int], gone: bool
) -> None:
    assert lease.holder_gone(holder, host="here", alive=alive_pids.__contains__) is gone


def test_a_lease_whose_holder_died_on_this_host_is_taken_at_once(tmp_path: Path) -> None:
    """A service killed and started again by its supervisor schedules at once, not after
    the dead one's TTL (the chaos campaign saw 8-10 s without reports stored)."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    factory = make_session_factory(engine)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    crashed = f"{socket.gethostname()}:{dead.pid}:0000"
    assert lease.try_acquire(factory, holder=crashed, ttl_s=30.0)
    assert lease.try_acquire(factory, holder=lease.holder_name(), ttl_s=30.0)
    live = f"{socket.gethostname()}:{os.getpid()}:0000"  # this process: alive
    assert not lease.try_acquire(factory, holder=live, ttl_s=30.0)
