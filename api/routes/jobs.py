"""`/v1/jobs`: submit, list, inspect and steer jobs.

Routes only read and request: run state changes by `elastrain.service.decisions.decide`. A cancel of
a job that no driver holds (queued, or waiting between attempts) is decided and applied at
once, in the request's transaction, by the same decision the scheduler would take. What a
submitted spec must pass is `elastrain.service.submission`'s policy; the route maps its
refusals to 422 and 429.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BeforeValidator, TypeAdapter
from pydantic_core import to_json
from sqlalchemy import Row
from sqlalchemy.orm import Session

from elastrain.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from elastrain.api.errors import Conflict, TooMany, invalid
from elastrain.api.logs import read_logs
from elastrain.api.schemas import CheckpointOut, EventOut, JobList, JobOut, LogChunk, MetricOut
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.storage import JobStorage
from elastrain.service import executor, metric_store, submission
from elastrain.service.auth import Principal
from elastrain.service.jobs import (
    JobNotFound,
    get_job,
    get_job_row,
    list_events,
    list_jobs,
    request_checkpoint,
)
from elastrain.service.models import Job
from elastrain.service.reports import list_checkpoints, list_metrics
from elastrain.service.states import ACTIVE, JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The job's id.")]
#: Steps, attempts and offsets are 32-bit columns (or compared with them): larger numbers
#: are a 422, not a database error.
MAX_INT32 = 2**31 - 1
#: As many label filters as a job can have labels.
MAX_LABEL_FILTERS = 32
# Accept `?state=running` as well as `?state=RUNNING`.
StateParam = Annotated[JobState, BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No such job", "content": {"application/json": {}}}
}
_CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"description": "Not possible in the job's state"}
}
_ACTIVE_NAMES = ", ".join(s.value for s in JobState if s in ACTIVE)


_EVENTS = TypeAdapter(list[EventOut])
#: Keys of a metric point that come from its row, not from what the workers reported.
_POINT_KEYS = frozenset({"step", "attempt", "at"})
_CHECKPOINTS = TypeAdapter(list[CheckpointOut])


def _json(
    body: bytes | str, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A ready JSON response.

    Routes serialise in their own worker thread and return this, so FastAPI neither
    re-validates the result nor hops to the threadpool again to do so: about a tenth of a
    request's CPU (docs/bench-api.md). `response_model` on each route still documents it.
    """
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")


def _job(
    job: Job | Row[Any] | dict[str, Any],
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> Response:
    return _json(JobOut.model_validate(job).model_dump_json(), status_code, headers)


def _owned_job(session: Session, job_id: int, who: Principal, *, for_update: bool = False) -> Job:
    """The job, if the caller may see it; another tenant's job is as good as absent (404,
    not 403: a 403 would confirm that the id exists)."""
    job = get_job(session, job_id, for_update=for_update)
    if not who.sees(job.owner):
        raise JobNotFound(job_id)
    return job


def _parse_labels(raw: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    if raw and len(raw) > MAX_LABEL_FILTERS:
        raise invalid(
            ("query", "label"), f"label: at most {MAX_LABEL_FILTERS} filters, got {len(raw)}"
        )
    for i, item in enumerate(raw or []):
        key, sep, value = item.partition(":")
        if not sep or not key:
            raise invalid(("query", "label", i), f"label: expected 'key:value', got {item!r}")
        labels[key] = value
    return labels


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    summary="Submit a job",
    responses={
        422: {"description": "The spec is invalid; `message` says which field and why"},
        429: {"description": "The tenant's queue is full (ELASTRAIN_MAX_QUEUED_JOBS_PER_TENANT)"},
    },
)
def submit_job(
    spec: JobSpec, session: SessionDep, who: CurrentPrincipal, settings: SettingsDep
) -> Response:
    try:
        job = submission.submit(session, spec, who, settings)
    except submission.SpecRefused as refused:
        raise RequestValidationError(
            [{"loc": ("body", *p.field), "msg": p.message, "type": "value_error"}
             for p in refused.problems]
        ) from None  # fmt: skip
    except submission.QueueFull as full:
        raise TooMany(str(full), retry_after_s=full.retry_after_s) from None
    session.commit()
    return _job(job, status.HTTP_201_CREATED, {"Location": f"/v1/jobs/{job.id}"})


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs_route(
    session: SessionDep,
    who: CurrentPrincipal,
    state: Annotated[
        list[StateParam] | None, Query(description="Only jobs in any of these states.")
    ] = None,
    label: Annotated[
        list[str] | None, Query(description="Only jobs with all of these `key:value` labels.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_INT32)] = 0,
) -> Response:
    page = list_jobs(
        session,
        states=sorted(set(state or ())),  # a repeated state is one filter
        labels=_parse_labels(label),
        owner=who.owner_filter,
        limit=limit,
        offset=offset,
    )
    items = [JobOut.model_validate(job) for job in page.items]
    return _json(
        JobList(items=items, total=page.total, limit=limit, offset=offset).model_dump_json()
    )


@router.get("/{job_id}", response_model=JobOut, responses=_NOT_FOUND)
def get_job_route(job_id: JobId, session: SessionDep, who: CurrentPrincipal) -> Response:
    job = get_job_row(session, job_id)  # a Core row: nothing here changes the job
    if not who.sees(job.owner):
        raise JobNotFound(job_id)
    return _job(job)


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Cancel a job",
    responses={
        200: {
            "description": "Cancelled at once: no driver held it (queued, or waiting between "
            "attempts), or it was already CANCELLED"
        },
        202: {"description": "Cancel requested; the scheduler stops the job's driver"},
        **_NOT_FOUND,
        **_CONFLICT,
    },
)
def cancel_job(
    job_id: JobId, session: SessionDep, who: CurrentPrincipal, settings: SettingsDep
) -> Response:
    # FOR UPDATE (PostgreSQL): the scheduler cannot admit it between our read and write.
    job = _owned_job(session, job_id, who, for_update=True)
    if job.state == JobState.CANCELLED:
        # Idempotent: a retried cancel gets the same answer, not an error.
        return _job(job)
    if job.state.is_terminal:
        raise Conflict(f"job {job_id} already finished ({job.state.value}); nothing to cancel")
    executor.cancel(session, job, storage_path=settings.storage_path)
    session.commit()
    return _job(job, status.HTTP_200_OK if job.state.is_terminal else status.HTTP_202_ACCEPTED)


@router.post(
    "/{job_id}/checkpoint",
    response_model=JobOut,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Ask a running job to save a checkpoint now",
    responses={**_NOT_FOUND, **_CONFLICT},
)
def checkpoint_now(job_id: JobId, session: SessionDep, who: CurrentPrincipal) -> Response:
    job = _owned_job(session, job_id, who, for_update=True)
    if not job.state.is_active:
        raise Conflict(
            f"job {job_id} is {job.state.value}; a checkpoint can be requested only while "
            f"it is {_ACTIVE_NAMES}"
        )
    if (job.spec.get("workload") or {}).get("command") is not None:
        raise Conflict(
            f"job {job_id} runs its own script (workload.command), which saves its "
            "checkpoints itself (in ELASTRAIN_JOB_DIR); the service cannot ask it for one"
        )
    if request_checkpoint(session, job):
        session.commit()
    return _job(job, status.HTTP_202_ACCEPTED)


@router.get("/{job_id}/events", response_model=list[EventOut], responses=_NOT_FOUND)
def job_events(job_id: JobId, session: SessionDep, who: CurrentPrincipal) -> Response:
    _owned_job(session, job_id, who)
    return _json(
        _EVENTS.dump_json(
            _EVENTS.validate_python(list_events(session, job_id), from_attributes=True)
        )
    )


@router.get(
    "/{job_id}/metrics",
    response_model=list[MetricOut],
    responses=_NOT_FOUND,
    summary="A job's per-step metrics, whole or downsampled to max_points",
)
def job_metrics(
    job_id: JobId,
    session: SessionDep,
    who: CurrentPrincipal,
    settings: SettingsDep,
    since_step: Annotated[
        int, Query(ge=0, le=MAX_INT32, description="Only steps >= this one.")
    ] = 0,
    until_step: Annotated[
        int, Query(ge=0, le=MAX_INT32, description="Only steps <= this one.")
    ] = MAX_INT32,
    limit: Annotated[
        int, Query(ge=1, le=10_000, description="Without max_points: at most this many rows.")
    ] = 10_000,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=10_000,
            description="At most this many points over the range, keeping the curve's shape: "
            "every step when they fit, else per bucket of steps the rows with the lowest and "
            "highest loss, the slowest step and the last held-out loss, and always the first "
            "and last step. Real rows, never averages.",
        ),
    ] = None,
) -> Response:
    job = _owned_job(session, job_id, who)
    if max_points is None:
        found = list_metrics(session, job_id, since_step=since_step, until_step=until_step,
                             limit=limit)  # fmt: skip
    else:
        found = metric_store.downsampled(
            session, job_id, since_step=since_step, until_step=until_step, max_points=max_points,
            thinned=job.metrics_thinned_at is not None,
        )  # fmt: skip
    # The reported values sit beside step/attempt/at (which win over a value of that name).
    # Rows of our own table need no validation: serialised as they are, the shape of
    # `MetricOut` (non-finite numbers as null, as pydantic writes them), a third of the
    # CPU of validating thousands of points first.
    rows: list[dict[str, Any]] = [
        {"step": m.step, "attempt": m.attempt, "at": m.at,
         **{k: v for k, v in m.values.items() if k not in _POINT_KEYS}}
        for m in found
    ]  # fmt: skip
    body = to_json(rows, inf_nan_mode="null")
    if len(body) <= settings.metric_bytes_per_response:
        return _json(body)
    # Rows a job stored before the per-point bounds, or many of the most a point may hold:
    # the first rows that fit, and where the next page starts.
    # A single row past the whole budget (stored before the bounds) is skipped.
    kept = _rows_within(rows, settings.metric_bytes_per_response)
    headers = {TRUNCATED_AT: str((kept or rows)[-1 if kept else 0]["step"] + 1)}
    return _json(to_json(kept, inf_nan_mode="null"), headers=headers)


#: Set on a `GET .../metrics` answer cut at ELASTRAIN_METRIC_BYTES_PER_RESPONSE: the
#: `since_step` of the next page.
TRUNCATED_AT = "X-Elastrain-Truncated-Next-Since-Step"


def _rows_within(rows: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The longest prefix of `rows` whose JSON fits in `budget` bytes."""
    used = 2  # the brackets
    for n, row in enumerate(rows):
        used += len(to_json(row, inf_nan_mode="null")) + 1
        if used > budget:
            return rows[:n]
    return rows


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut], responses=_NOT_FOUND)
def job_checkpoints(job_id: JobId, session: SessionDep, who: CurrentPrincipal) -> Response:
    _owned_job(session, job_id, who)
    rows = list_checkpoints(session, job_id)
    return _json(_CHECKPOINTS.dump_json(_CHECKPOINTS.validate_python(rows, from_attributes=True)))


@router.get("/{job_id}/logs", response_model=LogChunk, responses=_NOT_FOUND)
def job_logs(
    job_id: JobId,
    session: SessionDep,
    who: CurrentPrincipal,
    settings: SettingsDep,
    offset: Annotated[
        str, Query(max_length=4096, description="0, a byte offset, or an earlier next_offset.")
    ] = "0",
    attempt: Annotated[
        int | None, Query(ge=0, le=MAX_INT32, description="Which attempt (default: the newest).")
    ] = None,
) -> LogChunk:
    _owned_job(session, job_id, who)
    session.close()  # reading files needs no DB connection
    chunk = read_logs(
        JobStorage.of(settings.storage_path, job_id).logs,
        offset=offset,
        attempt=attempt,
        max_bytes=settings.log_bytes_per_response,
        max_files=settings.log_files_per_job,
    )
    return LogChunk(
        text=chunk.text,
        next_offset=chunk.next_offset,
        attempt=chunk.attempt,
        latest_attempt=chunk.latest_attempt,
        files=chunk.files,
    )
