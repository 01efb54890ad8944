"""The straggler rule (`workers/runtime/stragglers.py`): which ranks are slow, from the
local work per step each rank reports."""

from __future__ import annotations

import pytest

from elastrain.contracts.messages import Control
from elastrain.contracts.spec import FailureSpec
from elastrain.service import drains
from elastrain.service.capacity import DrainSource
from elastrain.service.decisions import RecordEvent, SendControl, Transition, decide
from elastrain.service.states import JobState as S
from elastrain.workers.runtime.stragglers import Streak, confirm, confirmed, find_stragglers
from tests.unit.test_decisions import NOW, facts, job, nodes, report


def steady(seconds: float, steps: range = range(1, 31)) -> list[tuple[int, float]]:
    return [(s, seconds) for s in steps]


def mostly(slow: float, fast: float, steps: range = range(1, 31)) -> list[tuple[int, float]]:
    """Slow on three steps of every four."""
    return [(s, fast if s % 4 == 0 else slow) for s in steps]


def bursty(fast: float, slow: float, steps: range = range(1, 31)) -> list[tuple[int, float]]:
    """Slow on every other step: noise on a busy machine."""
    return [(s, slow if s % 2 else fast) for s in steps]


@pytest.mark.parametrize(
    ("local", "threshold", "window", "slow"),
    [
        # one rank twice as slow as the rest: found, at any world size from two
        ({0: steady(0.010), 1: steady(0.020)}, 0.25, 20, [1]),
        ({0: steady(0.010), 1: steady(0.010), 2: steady(0.010), 3: steady(0.02)}, 0.25, 20, [3]),
        # slow on every other step (noise, bursts): slow on average, not on most steps
        ({0: steady(0.010), 1: bursty(0.010, 0.030)}, 0.25, 20, []),
        # slow on three steps of four: stays above
        ({0: steady(0.010), 1: mostly(0.030, 0.010)}, 0.25, 20, [1]),
        # within the threshold: not a straggler
        ({0: steady(0.010), 1: steady(0.012)}, 0.25, 20, []),
        # a lower threshold finds it
        ({0: steady(0.010), 1: steady(0.012)}, 0.1, 20, [1]),
        # above the threshold, but by microseconds: jitter, not a straggler
        ({0: steady(0.0001), 1: steady(0.0003)}, 0.25, 20, []),
        # fewer common steps than the window: not yet
        ({0: steady(0.010, range(1, 15)), 1: steady(0.020, range(1, 15))}, 0.25, 20, []),
        # ranks polled a step apart: judged over the steps both reported
        ({0: steady(0.010, range(1, 31)), 1: steady(0.020, range(2, 32))}, 0.25, 20, [1]),
        # only the last window counts: slow long ago, fast now
        (
            {
                0: steady(0.010, range(1, 41)),
                1: steady(0.030, range(1, 21)) + steady(0.010, range(21, 41)),
            },
            0.25,
            20,
            [],
        ),
        # one rank: nothing to compare with
        ({0: steady(0.010)}, 0.25, 20, []),
        # two of four slow: both found (each against the median of the other three)
        ({0: steady(0.01), 1: steady(0.01), 2: steady(0.03), 3: steady(0.03)}, 0.25, 20, [2, 3]),
    ],
)
def test_which_ranks_are_stragglers(local, threshold, window, slow):
    found = find_stragglers(local, threshold=threshold, window=window)
    assert [s.rank for s in found] == slow


def test_a_straggler_reports_how_much_slower_it_is():
    (found,) = find_stragglers({0: steady(0.01), 1: steady(0.01), 2: steady(0.025)},
                               threshold=0.25, window=20)  # fmt: skip
    assert found.rank == 2
    assert found.local_s == pytest.approx(0.025)
    assert found.others_s == pytest.approx(0.01)
    assert found.ratio == pytest.approx(2.5)


# -- what the control plane does with them: keep off their nodes (`failure.stragglers`) ------

REPORT = FailureSpec()
EVICT = FailureSpec(stragglers="evict", straggler_cooldown_s=600)


@pytest.mark.parametrize(
    ("failure", "slow", "kept", "now", "expected"),
    [
        # report (the default): never kept off a node
        (REPORT, ["b"], {}, 1000.0, {}),
        # evict: the straggler's node, for the cooldown from now
        (EVICT, ["b"], {}, 1000.0, {"b": 1600.0}),
        # still slow while leaving: the cooldown does not restart
        (EVICT, ["b"], {"b": 1600.0}, 1200.0, {"b": 1600.0}),
        # the cooldown over: the job may grow back onto it
        (EVICT, [], {"b": 1600.0}, 1600.0, {}),
        # another node slow later: both kept off, each until its own time
        (EVICT, ["c"], {"b": 1600.0}, 1200.0, {"b": 1600.0, "c": 1800.0}),
        # a cooldown running when the job's spec says report: runs out as set
        (REPORT, ["b"], {"b": 1600.0}, 1200.0, {"b": 1600.0}),
    ],
)
def test_which_nodes_a_job_keeps_off(failure, slow, kept, now, expected):
    assert drains.keep_off(failure, slow, kept, now=now) == expected


def test_a_job_leaves_a_straggler_node_as_it_leaves_a_draining_one():
    """A kept-off node is the job's own drain: it leaves at the next step boundary with its
    state in memory (LEAVE, no checkpoint, no restart), saying why."""
    (kept,) = drains.kept_off_drains({"b": NOW + 600})
    assert kept.source == DrainSource.STRAGGLER
    free, draining = drains.effective(nodes("a", "b"), [kept])
    actions = decide(job(S.RUNNING), facts(free, report=report(), draining=draining))
    assert SendControl(control=Control.LEAVE) in actions
    (resize,) = [a for a in actions if isinstance(a, Transition)]
    assert resize.to == S.RESIZING and resize.world_size == 1
    assert "kept off (a straggler ran there" in resize.reason
    (event,) = [a for a in actions if isinstance(a, RecordEvent)]
    assert event.details is not None and event.details["source"] == "straggler"


@pytest.mark.parametrize(
    ("found", "newest", "before", "after", "counted"),
    [
        # found once: not yet a straggler
        ({1}, 30, {}, {1: Streak(1, 30)}, set()),
        # found again over a window that shares no step with the last: it counts
        ({1}, 40, {1: Streak(1, 30)}, {1: Streak(2, 40)}, {1}),
        # found again on a poll that saw too few new steps: nothing confirmed
        ({1}, 35, {1: Streak(1, 30)}, {1: Streak(1, 30)}, set()),
        # not found: the streak is gone (a burst of contention is over)
        (set(), 40, {1: Streak(1, 30)}, {}, set()),
        ({0}, 50, {1: Streak(2, 40)}, {0: Streak(1, 50)}, set()),
        # a confirmed one stays confirmed while found
        ({1}, 45, {1: Streak(2, 40)}, {1: Streak(2, 40)}, {1}),
    ],
)
def test_a_straggler_is_confirmed_on_two_windows_in_a_row(
    found: set[int],
    newest: int,
    before: dict[int, Streak],
    after: dict[int, Streak],
    counted: set[int],
) -> None:
    streaks = confirm(found, newest, before, window=10)
    assert streaks == after
    assert confirmed(streaks) == counted
