"""The runtime answers only its own: capabilities derived from the control key, checked by
the runtime actor and the pool's worker processes, refusals logged without a flood. With
fakes (no Ray); the real cluster's check is tests/integration/test_runtime_capability_ray.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from elastrain.contracts.capability import (
    Keyring,
    attempt_capability,
    control_token,
    matches_digest,
    new_control_key,
    pool_token,
    token_digest,
)
from elastrain.contracts.messages import Control, StepMetrics
from elastrain.contracts.runtime import AttemptKey, Reconcile
from elastrain.service import identity
from elastrain.service.db import make_engine, make_session_factory, migrate
from elastrain.workers.process import WorkerProcess
from elastrain.workers.runtime.actor import Runtime
from elastrain.workers.runtime.guard import RefusalLog, Refused

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


# -- the capabilities -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("job_id", "attempt", "presented", "accepted"),
    [
        pytest.param(7, 2, attempt_capability(KEY, 7, 2), True, id="its-own"),
        pytest.param(7, 2, attempt_capability(KEY, 7, 1), False, id="another-attempt"),
        pytest.param(7, 2, attempt_capability(KEY, 8, 2), False, id="another-job"),
        pytest.param(7, 2, attempt_capability(OTHER_KEY, 7, 2), False, id="another-control-key"),
        pytest.param(7, 2, control_token(KEY), False, id="the-control-token"),
        pytest.param(7, 2, pool_token(KEY), False, id="the-pool-token"),
        pytest.param(7, 2, "", False, id="empty"),
        pytest.param(7, 2, None, False, id="missing"),
        pytest.param(7, 2, 12345, False, id="not-a-string"),
        pytest.param(7, 2, attempt_capability(KEY, 7, 2).upper(), False, id="case-changed"),
    ],
)
def test_an_attempt_is_acted_on_with_its_own_capability_alone(
    job_id: int, attempt: int, presented: object, accepted: bool
) -> None:
    assert Keyring(KEY).is_attempt(job_id, attempt, presented) is accepted


def test_the_three_tokens_differ_and_depend_on_the_key() -> None:
    tokens = {control_token(KEY), pool_token(KEY), attempt_capability(KEY, 1, 1)}
    assert len(tokens) == 3
    assert control_token(KEY) != control_token(OTHER_KEY)
    keys = Keyring(KEY)
    assert keys.is_control(control_token(KEY)) and not keys.is_control(control_token(OTHER_KEY))
    assert not keys.is_control(None) and not keys.is_control(pool_token(KEY))
    # Job 1 attempt 12 and job 11 attempt 2 are different messages, not one.
    assert attempt_capability(KEY, 1, 12) != attempt_capability(KEY, 11, 2)


def test_a_control_key_is_32_random_bytes() -> None:
    assert len(new_control_key()) == 32 and new_control_key() != new_control_key()
    with pytest.raises(ValueError, match="32"):
        Keyring(b"short")


def test_a_holder_of_the_digest_checks_the_token_without_holding_it() -> None:
    digest = token_digest(pool_token(KEY))
    assert pool_token(KEY).encode() not in digest
    assert matches_digest(digest, pool_token(KEY))
    assert not matches_digest(digest, pool_token(OTHER_KEY))
    assert not matches_digest(digest, digest.hex()) and not matches_digest(digest, None)
    assert not matches_digest(b"", "")  # a process made without a digest takes nothing


# -- the refusal log --------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_with_the_claimed_key_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    refusals = RefusalLog("runtime", interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="elastrain.guard"):
        for _ in range(1000):
            error = refusals.refuse("release", AttemptKey(3, 1))
        assert isinstance(error, Refused) and "AttemptKey(job_id=3, attempt=1)" in str(error)
        refusals.refuse("push_many", AttemptKey(4, 1))  # another kind: its own line
        clock.now = 10.5
        refusals.refuse("release", AttemptKey(3, 2))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "release refused" in lines[0] and "job_id=3, attempt=1" in lines[0]
    assert "push_many refused" in lines[1]
    assert "attempt=2" in lines[2] and "999 more refused" in lines[2]


# -- the runtime actor ------------------------------------------------------------------------
class _Driver:
    def __init__(self, job_id: int) -> None:
        self.request = type("Req", (), {"name": f"a{job_id}", "sent_at": 0.0, "job": job_id})()
        self.pushed: list[tuple[int, list[Any]]] = []
        self.released = False
        self.controls: list[Control] = []

    def push_batch(self, number: int, messages: list[Any]) -> None:
        self.pushed.append((number, messages))

    def release(self) -> None:
        self.released = True

    def request_control(self, control: Control) -> None:
        self.controls.append(control)


class _Pool:
    lock = threading.RLock()
    workers: dict[str, Any] = {}

    def forget_job(self, job: Any) -> None:
        raise AssertionError("a refused call forgets nothing")

    def abort_strays(self, live: Any) -> None:
        raise AssertionError("a refused call aborts nothing")


def _runtime() -> tuple[Runtime, dict[AttemptKey, _Driver]]:
    """The actor's object without Ray: its keys, its drivers, a pool that must not be used."""
    runtime = Runtime.__new__(Runtime)
    runtime.keys = Keyring(KEY)
    runtime.refusals = RefusalLog("runtime")
    runtime.pool = _Pool()  # type: ignore[assignment]
    runtime._lock = threading.Lock()
    drivers = {AttemptKey(1, 1): _Driver(1), AttemptKey(2, 1): _Driver(2)}
    runtime.drivers = dict(drivers)  # type: ignore[arg-type]
    return runtime, drivers


def test_another_attempts_key_releases_nothing_and_reconcile_needs_the_control_token() -> None:
    runtime, drivers = _runtime()
    b_capability = attempt_capability(KEY, 2, 1)  # what job 2's rank holds
    for token in (None, "", b_capability, pool_token(KEY), control_token(OTHER_KEY)):
        with pytest.raises(Refused):
            runtime.release(token, AttemptKey(1, 1), True)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            runtime.reconcile(token, Reconcile())  # type: ignore[arg-type]
        with pytest.raises(Refused):
            runtime.request(token, AttemptKey(1, 1), Control.STOP)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            runtime.workers(token)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            runtime.launch(token, object())  # type: ignore[arg-type]
    assert set(runtime.drivers) == set(drivers)
    assert not any(d.released or d.controls for d in drivers.values())
    assert runtime.owned_by(control_token(KEY)) and not runtime.owned_by(control_token(OTHER_KEY))

    runtime.release(control_token(KEY), AttemptKey(2, 1))  # the control plane's own call
    assert drivers[AttemptKey(2, 1)].released and AttemptKey(2, 1) not in runtime.drivers


def test_reports_are_taken_with_the_attempts_own_capability_alone() -> None:
    runtime, drivers = _runtime()
    fake = [StepMetrics(step=1, loss=0.0, wall_time=0.0)]
    for capability in (attempt_capability(KEY, 2, 1), "made-up", None, control_token(KEY)):
        with pytest.raises(Refused):
            runtime.push_many(AttemptKey(1, 1), capability, 0, fake)  # type: ignore[arg-type]
    with pytest.raises(Refused):
        runtime.push_many("not a key", "x", 0, fake)  # type: ignore[arg-type]
    assert drivers[AttemptKey(1, 1)].pushed == []

    runtime.push_many([1, 1], attempt_capability(KEY, 1, 1), 0, fake)  # type: ignore[arg-type]
    assert drivers[AttemptKey(1, 1)].pushed == [(0, fake)]


# -- the pool's worker processes --------------------------------------------------------------
def _process() -> WorkerProcess:
    process = WorkerProcess.__new__(WorkerProcess)  # no Ray, no torch: the checks alone
    process._lock = threading.Lock()
    process._pool_digest = token_digest(pool_token(KEY))
    process._refusals = RefusalLog("worker")
    process._busy, process._running, process._controls = True, AttemptKey(1, 1), {}
    process._abort = threading.Event()
    return process


def test_a_worker_process_acts_only_on_the_pools_token() -> None:
    process = _process()
    for token in (
        None,
        "",
        attempt_capability(KEY, 1, 1),
        control_token(KEY),
        pool_token(OTHER_KEY),
    ):
        with pytest.raises(Refused):
            process.abort(token)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            process.control(token, AttemptKey(1, 1), [Control.STOP])  # type: ignore[arg-type]
        with pytest.raises(Refused):
            process.forget(token)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            process.free_gpu(token)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            process.host_store(token, 2, 1.0)  # type: ignore[arg-type]
        with pytest.raises(Refused):
            process.run(token, object())  # type: ignore[arg-type]
        assert not process.accepts(token)  # type: ignore[arg-type]
    assert not process._abort.is_set() and process._controls == {}
    assert process.accepts(pool_token(KEY))
    process.control(pool_token(KEY), AttemptKey(1, 1), [Control.STOP])
    assert process._controls == {AttemptKey(1, 1): [Control.STOP]}


# -- the key's home ----------------------------------------------------------------------------
def test_the_control_key_is_made_once_and_kept_in_the_database(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    sessions = make_session_factory(engine)
    key = identity.runtime_control_key(sessions)
    assert len(key) == 32
    assert identity.runtime_control_key(sessions) == key  # a restarted control plane's
    assert identity.runtime_control_token(sessions) == control_token(key)
    engine.dispose()

    fresh = make_engine(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    migrate(fresh)
    assert identity.runtime_control_key(make_session_factory(fresh)) != key
    fresh.dispose()
