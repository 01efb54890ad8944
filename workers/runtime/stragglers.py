"""The straggler watch: which ranks of a running attempt are slow, from the local work
per step their processes report to the runtime's poll (`elastrain.workers.local_work`).
Pure: table-tested in tests/unit/test_stragglers.py; the driver polls, reports and the
control plane decides what to do (`failure.stragglers`).

A synchronous job steps at its slowest rank's pace, so every rank's step takes the same
wall time; the local work (its batch and its update) is what differs. A rank is a
straggler when, over the last `window` steps that every rank reported, its local work
stays above the median of the OTHER ranks' by more than `threshold` (0.25: 25 %): on at
least `STAYS_ABOVE` of those steps (a slower device is slower on nearly every step; noise
on a busy machine makes single steps slow, not most), and on average, by at least
`MIN_EXCESS_S` (jitter of a few hundred microseconds on tiny updates is no straggler).
The median of the others, not of all: with two ranks the median of all would sit halfway
between them. And found so on `CONFIRMATIONS` polls in a row, over windows that share no
step (`confirm`): steps of a few milliseconds make a window a fraction of a second, which a
burst of contention on a shared machine can fill (CI once evicted a healthy rank so).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Below this excess over the others' median (seconds per step), no rank is a straggler.
MIN_EXCESS_S = 0.0005
#: The share of the window's steps a straggler's local work is above the threshold on.
STAYS_ABOVE = 0.75
#: The polls in a row (windows sharing no step) a rank must be found slow on to count.
CONFIRMATIONS = 2


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    local_s: float
    """Its mean local work per step over the window."""
    others_s: float
    """The median of the other ranks' means."""

    @property
    def ratio(self) -> float:
        return self.local_s / self.others_s if self.others_s > 0 else float("inf")


def find_stragglers(
    local: Mapping[int, Sequence[tuple[int, float]]], *, threshold: float, window: int
) -> list[Straggler]:
    """The stragglers among ranks reporting (step, local seconds) pairs; none until every
    rank reported the same `window` steps."""
    if len(local) < 2:
        return []
    per_rank = {rank: dict(pairs) for rank, pairs in local.items()}
    common = set.intersection(*(set(steps) for steps in per_rank.values()))
    if len(common) < window:
        return []
    steps = sorted(common)[-window:]
    means = {rank: statistics.fmean(seen[s] for s in steps) for rank, seen in per_rank.items()}
    found = []
    for rank, mean in sorted(means.items()):
        others = statistics.median(m for r, m in means.items() if r != rank)
        above = sum(
            per_rank[rank][s] > (1 + threshold) * statistics.median(
                seen[s] for r, seen in per_rank.items() if r != rank
            )
            for s in steps
        )  # fmt: skip
        if (
            above >= STAYS_ABOVE * len(steps)
            and mean > others * (1 + threshold)
            and mean - others >= MIN_EXCESS_S
        ):
            found.append(Straggler(rank=rank, local_s=mean, others_s=others))
    return found


@dataclass(frozen=True, slots=True)
class Streak:
    """A rank found slow on `polls` polls in a row, the last counted at window end `step`."""

    polls: int
    step: int


def confirm(
    found: Iterable[int], newest: int, streaks: Mapping[int, Streak], window: int
) -> dict[int, Streak]:
    """The streaks after a poll that found the ranks `found` slow over a window ending at
    step `newest`: a rank not found loses its streak; a found one counts this poll only
    when its window shares no step with the last it counted (a poll that saw no new step
    confirms nothing)."""
    out = {}
    for rank in found:
        had = streaks.get(rank)
        if had is None:
            out[rank] = Streak(polls=1, step=newest)
        elif newest - had.step >= window:
            out[rank] = Streak(polls=had.polls + 1, step=newest)
        else:
            out[rank] = had
    return out


def confirmed(streaks: Mapping[int, Streak]) -> set[int]:
    return {rank for rank, streak in streaks.items() if streak.polls >= CONFIRMATIONS}
