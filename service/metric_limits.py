"""How much of a job's metrics the control plane stores: what rank 0 reports is the job's
code's to choose (names, values, how many, how fast), so it is bounded here, where it
enters shared state, whatever the workers did (issue 45; `Settings.metric_*`).

- a point keeps at most `names_per_point` names and `point_bytes` bytes of names and
  values (its built-in fields first; the workload's own names are cut past either);
- a job stores at most `points_per_s` points a second on average (a token bucket with a
  burst of `BURST_S` seconds' worth) and `points_per_job` in all.

What is cut is dropped, never queued, and said once per job and kind of limit in the
job's events (`Cut.kinds`). The decisions (`bound_point`, `TokenBucket`) are pure; the
per-job counts live in one `MetricBudgets` per control-plane process (the scheduler's).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from elastrain.contracts.messages import StepMetrics

#: A burst of this many seconds' worth of points is let through at once (a job that
#: resumes and re-sends what it computed while its reports were in flight).
BURST_S = 10.0
#: Text fields a point may carry, cut to this many characters.
_MAX_TEXT = 200


@dataclass(frozen=True, slots=True)
class MetricLimits:
    names_per_point: int = 64
    point_bytes: int = 4096
    points_per_s: float = 50.0
    points_per_job: int = 500_000


def _size(values: dict[str, object]) -> int:
    return len(json.dumps(values, default=str))


def bound_point(point: StepMetrics, limits: MetricLimits) -> tuple[StepMetrics, str | None]:
    """`point` within the per-point limits, and which one cut it (None: untouched)."""
    cut: str | None = None
    if point.mfu_basis is not None and len(point.mfu_basis) > _MAX_TEXT:
        point, cut = replace(point, mfu_basis=point.mfu_basis[:_MAX_TEXT]), "point_bytes"
    builtin = len(point.to_values()) - len(point.custom)
    room = max(0, limits.names_per_point - builtin - len(point.memory))
    if len(point.custom) > room or len(point.memory) > limits.names_per_point:
        memory = dict(list(point.memory.items())[: limits.names_per_point])
        custom = dict(list(point.custom.items())[: max(0, room)])
        point, cut = replace(point, custom=custom, memory=memory), "names_per_point"
    if _size(point.to_values()) > limits.point_bytes:
        point = replace(point, custom={}, memory={})
        cut = "point_bytes"
        if _size(point.to_values()) > limits.point_bytes:  # only a planted text is this big
            point = replace(point, mfu_basis=None)
    return point, cut


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens a second, at most `burst` held; a point takes one."""

    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        elapsed = max(0.0, now - self.at)  # a clock stepped back refills nothing
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class Cut:
    """What `MetricBudgets.admit` let through, and how many points each kind of limit cut
    (dropped, or trimmed to fit)."""

    points: list[StepMetrics]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def kinds(self) -> set[str]:
        return set(self.counts)

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1


@dataclass(slots=True)
class _Job:
    bucket: TokenBucket
    stored: int
    reported: set[str] = field(default_factory=set)


class MetricBudgets:
    """Each job's bucket and count of stored points, in this process."""

    def __init__(self, limits: MetricLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.clock = clock
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()

    def admit(
        self,
        job_id: int,
        points: Sequence[StepMetrics],
        *,
        stored: Callable[[], int],
        reported: Callable[[], set[str]] = set,
    ) -> Cut:
        """The points of `points` the job may store now, each within the per-point limits.
        `stored`: how many points the job has stored so far; `reported`: the kinds of
        limit its events already name (both read once per job and process, then kept
        here, so that a restarted scheduler neither resets a job's total nor says again
        what was said)."""
        limits = self.limits
        with self._lock:
            job = self._jobs.get(job_id)
            now = self.clock()
            if job is None:
                burst = max(1.0, limits.points_per_s * BURST_S)
                bucket = TokenBucket(limits.points_per_s, burst, burst, now)
                job = _Job(bucket, stored(), reported())
                self._jobs[job_id] = job
            cut = Cut(points=[])
            for point in points:
                if job.stored >= limits.points_per_job:
                    cut.count("points_per_job")
                    continue
                if not job.bucket.take(now):
                    cut.count("points_per_s")
                    continue
                bounded, why = bound_point(point, limits)
                if why is not None:
                    cut.count(why)
                cut.points.append(bounded)
                job.stored += 1
            return cut

    def first_report(self, job_id: int, kinds: set[str]) -> set[str]:
        """Of `kinds`, those not yet said for this job (each is said once)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return set(kinds)
            new = kinds - job.reported
            job.reported |= new
            return new

    def keep_only(self, job_ids: Iterable[int]) -> None:
        """Forget every job but `job_ids` (the running ones): a finished job reports no
        more, and this process holds one small record per running job only."""
        keep = set(job_ids)
        with self._lock:
            for job_id in [j for j in self._jobs if j not in keep]:
                del self._jobs[job_id]

    def clear(self) -> None:
        """Forget every job (another scheduler may have stored points meanwhile): each
        count is read again from the database, and each bucket starts full."""
        with self._lock:
            self._jobs.clear()


#: What each limit's event says.
DESCRIBE = {
    "names_per_point": "a metric point carried more names than ELASTRAIN_METRIC_NAMES_PER_POINT "
    "({names_per_point}): the rest dropped",
    "point_bytes": "a metric point held more than ELASTRAIN_METRIC_POINT_BYTES ({point_bytes} "
    "bytes): its own names dropped",
    "points_per_s": "metric points came faster than ELASTRAIN_METRIC_POINTS_PER_S "
    "({points_per_s:g}/s): the excess dropped",
    "points_per_job": "the job stored ELASTRAIN_METRIC_POINTS_PER_JOB ({points_per_job}) "
    "metric points: later ones dropped",
}


def describe(kind: str, limits: MetricLimits) -> str:
    return DESCRIBE[kind].format(
        names_per_point=limits.names_per_point,
        point_bytes=limits.point_bytes,
        points_per_s=limits.points_per_s,
        points_per_job=limits.points_per_job,
    )
