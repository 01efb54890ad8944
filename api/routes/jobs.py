"""`/v1/jobs`: submit, list, inspect and steer jobs.

Routes only read and request: run state changes by `elastrain.service.decisions.decide`. A cancel of
a job that no driver holds (queued, or waiting between attempts) is decided and applied at
once, in the request's transaction, by the same decision the scheduler would take.
"""

from __future__ import annotations

import pathlib
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
from elastrain.contracts.bounds import entrypoint_refusal, in_standard_library, private_part
from elastrain.contracts.datasets import data_path_problems
from elastrain.contracts.packages import OWN_PACKAGES, Manifest, modules_of
from elastrain.contracts.plan import AUTO_CHOICES, plan, shape_of
from elastrain.contracts.spec import JobSpec, StrategyKind
from elastrain.contracts.storage import JobStorage
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams
from elastrain.service import cluster, executor, metric_store, package_access
from elastrain.service.auth import Principal
from elastrain.service.jobs import (
    JobNotFound,
    get_job,
    get_job_row,
    insert_job,
    list_events,
    list_jobs,
    queued_jobs,
    request_checkpoint,
)
from elastrain.service.models import Job
from elastrain.service.packages import load_manifest, touch
from elastrain.service.reports import list_checkpoints, list_metrics
from elastrain.service.settings import Settings
from elastrain.service.states import ACTIVE, JobState
from elastrain.service.tracking import missing_clients
from elastrain.service.tracking.destinations import mlflow_uri_problem

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


def check_entrypoint(spec: JobSpec, allowed_prefixes: list[str]) -> None:
    entrypoint = spec.workload.entrypoint
    if entrypoint is not None and (why := entrypoint_refusal(entrypoint, allowed_prefixes)):
        raise invalid(("body", "workload", "entrypoint"), f"workload.entrypoint: {why}")


def check_workload_code(
    spec: JobSpec, settings: Settings, session: Session, who: Principal
) -> None:
    """The code the job will run exists and may run: an installed module the operator
    allows, or a module inside the job's uploaded package (which the operator's list does
    not restrict: it is the tenant's own code, shipped with the job). Another tenant's
    package is refused with the words used for a digest nobody uploaded."""
    workload = spec.workload
    if workload.command is not None:
        check_command_package(spec, settings, session, who)
        return
    if workload.package is None or workload.entrypoint is None:
        check_entrypoint(spec, settings.allowed_entrypoints)
        return
    if (private := private_part(workload.entrypoint)) is not None:
        raise invalid(
            ("body", "workload", "entrypoint"),
            f"workload.entrypoint: {private!r} is private (it starts with '_'); only public "
            "factories can run",
        )
    manifest = _visible_package(workload.package, settings, session, who)
    module = workload.entrypoint.partition(":")[0]
    where = ("body", "workload", "entrypoint")
    if in_standard_library(module) or module.split(".")[0] in OWN_PACKAGES:
        raise invalid(
            where,
            f"workload.entrypoint: module {module!r} has the name of a standard-library or "
            "elastrain module; rename it in your package",
        )
    if not manifest.has_module(module):
        have = ", ".join(modules_of(f.path for f in manifest.files)[:20]) or "none"
        raise invalid(
            where,
            f"workload.entrypoint: module {module!r} is not in package {workload.package} "
            f"(its modules: {have})",
        )
    touch(settings.storage_path, workload.package)  # in use: retention counts from now


def _visible_package(digest: str, settings: Settings, session: Session, who: Principal) -> Manifest:
    """The package's manifest, when it exists and is the caller's to use; else the one 422
    for both (another tenant's package reads as a missing one)."""
    manifest = load_manifest(settings.storage_path, digest)
    if manifest is None or not package_access.visible(session, digest, who):
        raise invalid(
            ("body", "workload", "package"),
            f"workload.package: no package {digest} on this service; upload the "
            "directory first (POST /v1/packages, or `elastrain submit --working-dir DIR`)",
        )
    return manifest


def check_command_package(
    spec: JobSpec, settings: Settings, session: Session, who: Principal
) -> None:
    """A command job's package exists, is the caller's to use, and holds the file the
    command runs (a typo is a 422 now, not a failed job later)."""
    workload = spec.workload
    if workload.package is None:
        return  # runs a module or a program the workers have: nothing uploaded to check
    manifest = _visible_package(workload.package, settings, session, who)
    script = workload.script_file
    paths = {f.path for f in manifest.files}
    if script is not None and script.removeprefix("./") not in paths:
        have = ", ".join(sorted(paths)[:20]) or "none"
        raise invalid(
            ("body", "workload", "command"),
            f"workload.command: {script!r} is not in package {workload.package} (its "
            f"files: {have})",
        )
    touch(settings.storage_path, workload.package)


def check_data_paths(spec: JobSpec, storage_root: pathlib.Path, owner: str) -> None:
    """A built-in gpt's (or hf_causal_lm's) data files exist in the owner's data area (or
    the shared one) and can make windows; an hf_causal_lm's model folder has a config."""
    params: GptParams | HfCausalLmParams
    if spec.workload.name == "gpt":
        params = GptParams.model_validate(spec.workload.params)
    elif spec.workload.name == "hf_causal_lm":
        params = HfCausalLmParams.model_validate(spec.workload.params)
    else:
        return
    problems = data_path_problems(params, storage_root, owner)
    if problems:  # each starts "workload.params.<key>:"
        raise RequestValidationError(
            [
                {"loc": ("body", *p.partition(":")[0].split(".")), "msg": p, "type": "value_error"}
                for p in problems
            ]
        )


def check_trackers(spec: JobSpec, settings: Settings) -> None:
    """Each tracker the spec names is one the operator allows (its destination: see
    `elastrain.service.tracking.destinations`) and has its client installed on the control
    plane, which is what forwards to it (the workers never do)."""
    if spec.tracking.mlflow is not None:
        problem = mlflow_uri_problem(
            spec.tracking.mlflow.tracking_uri,
            allowed=settings.allowed_trackers,
            operator_uri=settings.mlflow_tracking_uri,
        )
        if problem is not None:
            raise invalid(("body", "tracking", "mlflow", "tracking_uri"), problem)
    missing = missing_clients(spec)
    if missing:
        raise RequestValidationError(
            [
                {
                    "loc": ("body", "tracking", name),
                    "msg": f"tracking.{name}: install {extra} on the control plane (the "
                    f"service forwards to {name}; its client package is missing)",
                    "type": "value_error",
                }
                for name, extra in missing.items()
            ]
        )


def check_identity(spec: JobSpec, tenant: str, settings: Settings) -> None:
    """While the operator maps tenants to OS identities, a tenant without one runs no
    script (it would run as the workers' user, beside every other tenant's files)."""
    unmapped = tenant not in settings.tenant_identities
    if spec.workload.command and settings.tenant_users and unmapped:
        raise invalid(
            ("body", "workload", "command"),
            f"workload.command: tenant {tenant!r} has no OS identity to run scripts as "
            "(the operator's ELASTRAIN_TENANT_USERS); use a built-in workload",
        )


def check_queue(session: Session, tenant: str, settings: Settings) -> None:
    """A tenant's queue is bounded: every PENDING job is decided on every scheduler pass
    (admission sorts the whole queue), so one tenant's flood would slow every job's
    recovery. Past the limit a submit is a 429 naming it."""
    limit = settings.max_queued_jobs_per_tenant
    if queued_jobs(session, tenant) >= limit:
        raise TooMany(
            f"your tenant has {limit} jobs waiting in the queue, the most it may "
            "(ELASTRAIN_MAX_QUEUED_JOBS_PER_TENANT); submit again when some have started",
            retry_after_s=30,
        )


def check_auto_fits(spec: JobSpec, session: Session, settings: Settings) -> None:
    """An `auto` job must fit at some world size in min..max (tensor-parallel degrees need
    sizes they divide), when the workers' memory is known. The 422 carries the plan's
    numbers at max_workers."""
    if spec.strategy.kind != StrategyKind.auto:
        return
    memory = settings.worker_memory_bytes
    if memory is None and not spec.scaling.use_gpu:
        snapshot = cluster.current(session)
        memory = cluster.worker_memory_bytes(snapshot, spec.scaling.cpus_per_worker)
    shape = shape_of(spec)
    if memory is None or shape is None:
        return  # planned at launch, against what the cluster then says
    for size in reversed(spec.world_sizes):
        if plan(shape, spec, size, memory, eligible=AUTO_CHOICES).chosen is not None:
            return
    made = plan(shape, spec, spec.scaling.max_workers, memory, eligible=AUTO_CHOICES)
    raise invalid(("body", "strategy", "kind"), f"strategy.kind: auto: {made.why}")


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
    check_workload_code(spec, settings, session, who)
    check_data_paths(spec, settings.storage_path, who.tenant)
    check_auto_fits(spec, session, settings)
    check_trackers(spec, settings)
    check_queue(session, who.tenant, settings)
    check_identity(spec, who.tenant, settings)
    job = insert_job(session, spec=spec, owner=who.tenant)
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
