"""Bucket summaries and downsampling choices (pure)."""

from __future__ import annotations

import math

import pytest

from elastrain.service.metric_summary import (
    WIDTHS,
    Summary,
    merge,
    of_point,
    representative_steps,
    summarize,
    width_for,
)


def test_a_point_names_itself_for_what_it_has() -> None:
    assert of_point(7, {"loss": 2.0, "step_time_s": 0.1}) == Summary(
        lo_step=7, lo_loss=2.0, hi_step=7, hi_loss=2.0, slow_step=7, slow_s=0.1
    )
    assert of_point(7, {"loss": 2.0, "eval_loss": 1.9}).eval_step == 7
    # Not numbers (or not finite) are not extremes.
    for bad in ({"loss": None}, {"loss": "x"}, {"loss": math.nan}, {"loss": True}, {}):
        assert of_point(3, bad).steps() == set()


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # (lo_step, hi_step, slow_step, eval_step) of step 1's values merged with step 2's
        ({"loss": 2.0}, {"loss": 1.0}, (2, 1, None, None)),
        ({"loss": 1.0}, {"loss": 1.0}, (1, 1, None, None)),  # ties keep the first
        ({"loss": 1.0, "step_time_s": 5.0}, {"loss": 3.0, "step_time_s": 1.0}, (1, 2, 1, None)),
        ({"eval_loss": 1.0}, {"loss": 0.5}, (2, 2, None, 1)),
        ({"eval_loss": 1.0}, {"eval_loss": 2.0}, (None, None, None, 2)),
    ],
)
def test_merge(a: dict, b: dict, expected: tuple) -> None:  # type: ignore[type-arg]
    m = merge(of_point(1, a), of_point(2, b))
    assert (m.lo_step, m.hi_step, m.slow_step, m.eval_step) == expected


def test_merge_is_what_one_pass_over_the_steps_gives() -> None:
    points = [(s, {"loss": math.sin(s / 7.0) + s / 100, "step_time_s": 0.1 + (s % 13) / 100})
              for s in range(1, 2000)]  # fmt: skip
    by_bucket = summarize(points)
    # A coarse bucket equals the merge of its 8 finer ones: what lets retention keep only
    # the finest width's representatives.
    for (width, bucket), summary in by_bucket.items():
        if width == WIDTHS[0]:
            continue
        finer = [by_bucket.get((width // 8, bucket * 8 + i)) for i in range(8)]
        merged = None
        for f in finer:
            if f is not None:
                merged = f if merged is None else merge(merged, f)
        assert merged == summary, (width, bucket)
    lo = min(points, key=lambda p: p[1]["loss"])
    assert by_bucket[(WIDTHS[-1], 0)].lo_step == lo[0]


@pytest.mark.parametrize(
    ("first", "last", "max_points", "expected"),
    [
        (1, 100, 100, None),  # fits: raw
        (1, 2000, 2000, None),
        (1, 1_000_000, 2000, 512),  # 1,953 buckets of 512 >= 499 groups
        (1, 10_000, 2000, 8),
        (1, 2001, 2000, 8),  # just over: the finest
        (1, 1_000_000, 100, 32768),
        (1, 100_000_000, 50, 2097152),  # coarser than any: the coarsest
    ],
)
def test_width_for(first: int, last: int, max_points: int, expected: int | None) -> None:
    assert width_for(first, last, max_points) == expected


def test_width_for_a_thinned_job_starts_at_the_kept_width() -> None:
    assert width_for(1, 2001, 2000, min_width=64) == 64


def test_representatives_keep_spikes_dips_stalls_and_evals_within_budget() -> None:
    n = 100_000
    values = {s: {"loss": 3.0 - s / n, "step_time_s": 0.1} for s in range(1, n + 1)}
    values[31_337]["loss"] = 50.0  # a spike
    values[77_777]["loss"] = -1.0  # a dip
    values[50_001]["step_time_s"] = 9.0  # a stall (a checkpoint that blocked)
    for s in range(1000, n + 1, 1000):
        values[s]["eval_loss"] = 2.0
    buckets = summarize(values.items())
    max_points = 2000
    width = width_for(1, n, max_points)
    assert width is not None
    row = [buckets[(width, b)] for b in range(0, n // width + 1) if (width, b) in buckets]
    steps = representative_steps(row, max_points, 1, n)
    assert len(steps) <= max_points
    assert {1, n, 31_337, 77_777, 50_001} <= set(steps)
    evals = [s for s in steps if "eval_loss" in values[s]]
    assert len(evals) >= 90  # every held-out point but those sharing a group with another


def test_representatives_stay_inside_the_range() -> None:
    buckets = summarize((s, {"loss": float(s % 17)}) for s in range(0, 4096))
    row = [buckets[(64, b)] for b in range(64)]
    steps = representative_steps(row, 50, 100, 3000)
    assert steps[0] == 100 and steps[-1] == 3000 and len(steps) <= 50
