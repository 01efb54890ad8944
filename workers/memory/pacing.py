"""How often peer memory is refreshed: every step when that costs at most a budget (5 %)
of the step time, as measured while the job runs, else the smallest interval that does.

`choose_interval` is the pure rule; `RefreshPacer` feeds it measurements that every rank
of the group agrees on (the slowest rank's, all-reduced by the caller), so all ranks
refresh at the same steps: a refresh is a collective exchange. Refreshes fall on the
multiples of the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: The share of step time a refresh may cost at the chosen interval.
OVERHEAD_BUDGET = 0.05
#: Measurements are smoothed so one slow step does not swing the interval.
SMOOTHING = 0.5


def choose_interval(refresh_s: float, step_s: float, budget: float = OVERHEAD_BUDGET) -> int:
    """The smallest number of steps k >= 1 between refreshes such that one refresh per k
    steps costs at most `budget` of the training time: refresh_s / (k * step_s) <= budget."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if refresh_s <= 0 or step_s <= 0:
        return 1
    # A hair of tolerance: 0.05 / (0.05 * 1.0) must be 1, not 2, whatever the rounding.
    return max(1, math.ceil(refresh_s / (budget * step_s) * (1 - 1e-9)))


def overhead(refresh_s: float, step_s: float, every: int) -> float:
    """The share of training time refreshes take at one refresh every `every` steps."""
    return refresh_s / (every * step_s) if step_s > 0 else 0.0


@dataclass
class RefreshPacer:
    """When to refresh. `fixed`: the spec's `checkpoint.memory_every` (0: never); None:
    measured. The first refresh of an attempt plans its layout (a collective DCP plan) and
    allocates its buffers, so it does not count; the interval is chosen from the second
    on and revised after every refresh. Refreshes after the first fall on the interval's
    multiples."""

    fixed: int | None = None
    every: int = 1
    last: int | None = None
    """The step of the last refresh in this attempt."""
    refresh_s: float | None = None
    step_s: float | None = None
    refreshes: int = 0
    _step_times: list[float] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    @property
    def measured(self) -> bool:
        """Whether the interval is chosen from measurements (which the caller agrees on)."""
        return self.fixed is None

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether to refresh after optimizer step `step` (`final`: the group is about to
        stop, so the state is handed on as it is now)."""
        if not self.enabled:
            return False
        if final:
            return self.last != step
        interval = self.fixed if self.fixed is not None else self.every
        return self.last is None or step % interval == 0

    def stepped(self, seconds: float) -> None:
        """A training step's time (without any refresh)."""
        self._step_times.append(seconds)

    def mean_step_s(self) -> float:
        """Mean step time since the last refresh (what the caller all-reduces)."""
        times = self._step_times
        return sum(times) / len(times) if times else 0.0

    def refreshed(
        self, step: int, refresh_s: float | None = None, step_s: float | None = None
    ) -> None:
        """Record a refresh and, given measurements, choose the next interval;
        `refresh_s` and `step_s` must be the same on every rank (the group's slowest)."""
        self.last = step
        self.refreshes += 1
        if refresh_s is None or step_s is None:
            return  # a fixed interval: nothing to choose
        self._step_times = []
        if self.refreshes == 1:
            return  # planning and allocation: not what later refreshes cost
        self.refresh_s = _smooth(self.refresh_s, refresh_s)
        if step_s > 0:
            self.step_s = _smooth(self.step_s, step_s)
        if self.fixed is None and self.step_s is not None:
            self.every = choose_interval(self.refresh_s, self.step_s)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * old + (1 - SMOOTHING) * new
