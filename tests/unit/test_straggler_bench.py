"""bench/straggler_bench.py's windows: which steps each throughput is taken over."""

from __future__ import annotations

import pytest

from bench.straggler_bench import Point, before, during, settled, steps_per_s


def run(attempt: int, steps: range, *, start: float, step_s: float, world: int = 2) -> list[Point]:
    return [Point(s, attempt, world, start + i * step_s) for i, s in enumerate(steps)]


#: Steps 1-10 at 8 steps/s from t=0 (attempt 1), then 11-20 at 4 steps/s from t=2 (attempt 2)
#: (times exact in binary: a boundary compares as written).
POINTS = run(1, range(1, 11), start=0.0, step_s=0.125) + run(
    2, range(11, 21), start=2.0, step_s=0.25, world=1
)


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        ([], None),
        (POINTS[:1], None),  # one point: no interval
        ([Point(1, 1, 2, 5.0), Point(2, 1, 2, 5.0)], None),  # no time passed
        (POINTS[:10], 8.0),
        (POINTS[10:], 4.0),
        # a dropped point changes nothing: steps are counted by number, not by rows
        ([Point(1, 1, 2, 0.0), Point(4, 1, 2, 0.375)], 8.0),
    ],
)
def test_steps_per_s(window: list[Point], expected: float | None) -> None:
    assert steps_per_s(window) == (pytest.approx(expected) if expected else None)


@pytest.mark.parametrize(
    ("until", "steps", "expected_steps"),
    [
        (0.6, 3, [2, 3, 4, 5]),  # the last 3 steps done by then: 4 bounding points
        (0.6, 10, [1, 2, 3, 4, 5]),  # fewer done: all of them
        (-1.0, 3, []),
    ],
)
def test_before_takes_the_last_steps_done_by_then(
    until: float, steps: int, expected_steps: list[int]
) -> None:
    assert [p.step for p in before(POINTS, until, steps)] == expected_steps


@pytest.mark.parametrize(
    ("since", "attempt", "expected_steps"),
    [
        (0.65, 1, [6, 7, 8, 9, 10]),  # from the last step done at or before `since`
        (0.75, 1, [7, 8, 9, 10]),  # step 7 done exactly then: the origin
        (5.0, 1, [10]),  # nothing of attempt 1 after it: the origin only
        (0.0, 2, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]),  # no origin in that attempt
    ],
)
def test_during_starts_at_the_step_done_by_then(
    since: float, attempt: int, expected_steps: list[int]
) -> None:
    assert [p.step for p in during(POINTS, since, attempt)] == expected_steps


@pytest.mark.parametrize(
    ("attempt", "settle_s", "steps", "expected_steps"),
    [
        (2, 0.5, 3, [13, 14, 15, 16]),  # from the step done 0.5 s after the first: 3 steps
        (2, 0.6, 3, [14, 15, 16, 17]),  # none done exactly then: the next
        (2, 2.0, 3, [19, 20]),  # not that many yet
        (1, 0.0, 2, [1, 2, 3]),
        (3, 0.0, 2, []),  # no such attempt
    ],
)
def test_settled_skips_the_first_seconds_of_an_attempt(
    attempt: int, settle_s: float, steps: int, expected_steps: list[int]
) -> None:
    assert [p.step for p in settled(POINTS, attempt, settle_s, steps)] == expected_steps
