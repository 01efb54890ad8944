"""Per-bucket summaries of a job's metric rows, so a million-step curve can be drawn from
a few thousand real points (pure: no database here; `elastrain.service.reports` stores them).

For every width in `WIDTHS` (8, 64, ..., 8**7 steps) a job's steps fall into buckets
(`step // width`); each bucket remembers which of its steps had the lowest and the highest
loss, the slowest step, and the last step with a held-out loss. Those are the rows that
carry a curve's shape: its dips and spikes, its stalls, its evaluation points. A request
for at most N points over a range picks the width that gives at least N/4 buckets there,
merges neighbouring buckets into N/4 groups, and returns the representative rows of each
group plus the range's first and last rows: real rows, every value of those steps, never
an average that no step had (min/max per bucket, as Grafana and TensorBoard's downsamplers
keep extremes; LTTB would need the raw points at request time).

The summaries are exact for the steps they saw. A step re-reported by a later attempt
(after a resume) is merged in as a new value, so an extreme of the replaced value may
still name that step: the row it names exists and carries the newer values, and the curve
keeps its shape.

Width w's representatives are among width w/8's (a bucket's lowest loss is the lowest of
its sub-buckets' lowest), which is what lets retention thin old rows down to the
representatives at the finest width without changing any coarser answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

WIDTHS: tuple[int, ...] = tuple(8**k for k in range(1, 8))
#: Rows a group contributes at most: lowest loss, highest loss, slowest step, last eval.
ROWS_PER_GROUP = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    lo_step: int | None = None
    lo_loss: float | None = None
    hi_step: int | None = None
    hi_loss: float | None = None
    slow_step: int | None = None
    slow_s: float | None = None
    eval_step: int | None = None

    def steps(self) -> set[int]:
        return {
            s for s in (self.lo_step, self.hi_step, self.slow_step, self.eval_step) if s is not None
        }


def _number(values: Mapping[str, Any], key: str) -> float | None:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def of_point(step: int, values: Mapping[str, Any]) -> Summary:
    """One step on its own."""
    loss = _number(values, "loss")
    slow = _number(values, "step_time_s")
    return Summary(
        lo_step=step if loss is not None else None,
        lo_loss=loss,
        hi_step=step if loss is not None else None,
        hi_loss=loss,
        slow_step=step if slow is not None else None,
        slow_s=slow,
        eval_step=step if _number(values, "eval_loss") is not None else None,
    )


def merge(a: Summary, b: Summary) -> Summary:
    """Both buckets' (or a bucket's and a new step's) summary; ties keep `a`'s step."""
    lo = b if b.lo_loss is not None and (a.lo_loss is None or b.lo_loss < a.lo_loss) else a
    hi = b if b.hi_loss is not None and (a.hi_loss is None or b.hi_loss > a.hi_loss) else a
    slow = b if b.slow_s is not None and (a.slow_s is None or b.slow_s > a.slow_s) else a
    late = (
        b if b.eval_step is not None and (a.eval_step is None or b.eval_step > a.eval_step) else a
    )
    return Summary(
        lo_step=lo.lo_step, lo_loss=lo.lo_loss, hi_step=hi.hi_step, hi_loss=hi.hi_loss,
        slow_step=slow.slow_step, slow_s=slow.slow_s, eval_step=late.eval_step,
    )  # fmt: skip


def summarize(points: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[tuple[int, int], Summary]:
    """(width, bucket) -> summary of the given (step, values) at every width: the finest
    from the points in the order given, each coarser from the finer buckets in step order
    (so one point is looked at once, whatever the number of widths)."""
    finest_width = WIDTHS[0]
    level: dict[int, Summary] = {}
    for step, values in points:
        one = of_point(step, values)
        bucket = step // finest_width
        seen = level.get(bucket)
        level[bucket] = one if seen is None else merge(seen, one)
    out = {(finest_width, bucket): summary for bucket, summary in level.items()}
    for finer, width in pairwise(WIDTHS):
        coarser: dict[int, Summary] = {}
        for bucket in sorted(level):
            key = bucket * finer // width
            seen = coarser.get(key)
            coarser[key] = level[bucket] if seen is None else merge(seen, level[bucket])
        out.update(((width, bucket), summary) for bucket, summary in coarser.items())
        level = coarser
    return out


def width_for(first: int, last: int, max_points: int, min_width: int = WIDTHS[0]) -> int | None:
    """The bucket width to answer for steps first..last in at most `max_points` rows, or
    None when the raw rows fit (at most one row per step). `min_width`: the finest width
    still summarized (retention drops the finer ones of a thinned job)."""
    span = last - first + 1
    if span <= max_points:
        return None
    groups = max(1, (max_points - 2) // ROWS_PER_GROUP)
    usable = [w for w in WIDTHS if w >= min_width]
    fine_enough = [w for w in usable if span / w >= groups]
    return fine_enough[-1] if fine_enough else usable[0]


def representative_steps(
    buckets: Sequence[Summary], max_points: int, first: int, last: int
) -> list[int]:
    """The steps to return: buckets (in step order) merged into groups of neighbours, each
    group's representatives inside first..last, and first and last themselves."""
    groups = max(1, (max_points - 2) // ROWS_PER_GROUP)
    per_group = max(1, math.ceil(len(buckets) / groups))
    chosen = {first, last}
    for start in range(0, len(buckets), per_group):
        merged = buckets[start]
        for other in buckets[start + 1 : start + per_group]:
            merged = merge(merged, other)
        chosen |= {s for s in merged.steps() if first <= s <= last}
    return sorted(chosen)
