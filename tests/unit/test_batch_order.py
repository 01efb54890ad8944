"""Rank 0's batches are applied in the order it sent them, though the threaded runtime
actor may run the calls out of order (seen in CI: an attempt's timeline without its
restore, because the batch with its first step ran first)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from elastrain.contracts.messages import (
    DriverStatus,
    Phase,
    RestoreSource,
    StepMetrics,
    Timeline,
    TimelineMark,
    WorkerMessage,
)
from elastrain.workers.runtime.driver import AttemptDriver
from elastrain.workers.runtime.ordering import InOrder


@pytest.mark.parametrize(
    ("arrivals", "released"),
    [
        ([0, 1, 2], [[0], [1], [2]]),  # in order: each at once
        ([1, 0, 2], [[], [0, 1], [2]]),  # 1 waits for 0
        ([2, 1, 0], [[], [], [0, 1, 2]]),  # reversed: all at the end
        ([0, 0, 1], [[0], [], [1]]),  # a number seen before is dropped
        ([1, 2, 0, 1], [[], [], [0, 1, 2], []]),  # a late copy of a released one too
    ],
)
def test_batches_come_out_in_number_order(arrivals: list[int], released: list[list[int]]) -> None:
    order: InOrder[int] = InOrder()
    assert [order.add(n, [n]) for n in arrivals] == released


def test_a_gap_that_never_fills_stops_holding_at_the_bound() -> None:
    order: InOrder[int] = InOrder(max_held=2)
    assert order.add(1, [1]) == [] and order.add(2, [2]) == []
    assert order.add(3, [3]) == [1, 2, 3]  # batch 0 is not coming: the rest go, in order
    assert order.add(0, [0]) == []  # too late: dropped, never applied out of order


def driver() -> AttemptDriver:
    """The driver's intake alone: no thread, no Ray."""
    d = AttemptDriver.__new__(AttemptDriver)
    d.request = SimpleNamespace(cause="failed")  # type: ignore[assignment]
    d._lock, d._marks, d._batches = threading.Lock(), {}, InOrder()
    d._outbox, d._seq, d._status, d._command = [], 0, DriverStatus.STARTING, False
    d._placement = d._resumed_from = None
    return d


def test_the_timeline_has_its_restore_when_the_first_step_ran_first() -> None:
    restored = TimelineMark(phase=Phase.STATE_RESTORED, at=101.0, source=RestoreSource.PEER)
    first: list[WorkerMessage] = [
        StepMetrics(step=13, loss=1.0, wall_time=102.0),
        TimelineMark(phase=Phase.FIRST_STEP, at=102.0),
    ]
    d = driver()
    d.push(TimelineMark(phase=Phase.DETECTED, at=100.0))
    d.push_batch(1, first)  # the runtime's threads ran the second call first
    assert d._outbox == []
    d.push_batch(0, [restored])
    messages = [m for _, m in d._outbox]
    assert isinstance(messages[0], StepMetrics)
    (timeline,) = [m for m in messages if isinstance(m, Timeline)]
    assert [p["phase"] for p in timeline.phases()] == ["detected", "state_restored", "first_step"]
    assert timeline.phases()[1]["source"] == "peer"
    assert d._status == DriverStatus.RUNNING
