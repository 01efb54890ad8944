"""One job's bad row costs that job only: the admission plan without the jobs it cannot plan.

The scheduler decides about every unfinished job in one pass. A job whose stored spec makes
a decision raise (a row written around the API, or one from before a bound was added) must
not stop the pass for everyone else: its error becomes its own reason, and every other job
is decided as usual. `decide` is guarded job by job in the scheduler; admission plans all
queued jobs together, so a failure there is narrowed down here to the jobs that cause it.
Pure: no DB, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from elastrain.service.admission import Admission, Waiting
from elastrain.service.decisions import JobView

#: How long an error may be in a job's reason.
MAX_REASON = 1000

Plan = Callable[[Sequence[JobView]], tuple[list[Admission], list[Waiting]]]


def undecidable_reason(exc: BaseException) -> str:
    """A job's reason when deciding about it raised: the error in its own words."""
    return f"the scheduler cannot decide about this job: {type(exc).__name__}: {exc}"[:MAX_REASON]


@dataclass(frozen=True, slots=True)
class IsolatedPlan:
    admissions: list[Admission]
    waiting: list[Waiting]
    broken: dict[int, str] = field(default_factory=dict)
    """Jobs that cannot be planned even alone: job id -> why (they are to be failed)."""


def plan_isolating(plan: Plan, pending: Sequence[JobView]) -> IsolatedPlan:
    """`plan(pending)`; if it raises, each job is planned alone to find the ones that
    raise, and the others are planned without them. If the rest still cannot be planned
    together (an error no single job causes), every queued job waits with it as reason:
    nothing is started on a plan that did not complete."""
    try:
        admissions, waiting = plan(pending)
        return IsolatedPlan(admissions, waiting)
    except Exception:
        pass
    broken: dict[int, str] = {}
    for job in pending:
        try:
            plan([job])
        except Exception as exc:
            broken[job.id] = undecidable_reason(exc)
    rest = [job for job in pending if job.id not in broken]
    try:
        admissions, waiting = plan(rest)
    except Exception as exc:
        reason = f"admission is failing: {type(exc).__name__}: {exc}"[:MAX_REASON]
        return IsolatedPlan([], [Waiting(job_id=job.id, reason=reason) for job in rest], broken)
    return IsolatedPlan(admissions, waiting, broken)
