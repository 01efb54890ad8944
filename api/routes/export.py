"""`GET /v1/jobs/{id}/export`: a committed checkpoint as a Hugging Face model folder,
streamed as a tar (`config.json`, `model.safetensors`, `generation_config.json`);
`elastrain export JOB --format hf --out DIR` unpacks it.

The API checks the caller may see the job (another tenant's job is a 404, as everywhere)
and picks the step from the manifests (JSON, read confined). Every byte of the checkpoint
is the job's to write, so the API reads none of the rest: the conversion is a Ray task on
the cluster (`elastrain.workers.export_task`), run with the rights the job's own ranks
have, which reads the weights whole (the workers need the `hf` extra, and memory for two
copies of the model's weights while it runs, so exports at once are bounded:
`ExportSlots`, a 429 past them) and writes JSON and safetensors files only. The API copies
those into a tar without parsing them (`pack_export`: no link followed, regular files of
those two kinds, no more bytes than the checkpoint holds) and deletes them. The task too
reads the checkpoint as hostile input (`elastrain.checkpoints.dcp.untrusted`) in a child
with no secrets. Whatever it refuses is a 409 naming the step, never a server path.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from elastrain.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from elastrain.api.errors import Conflict, Unavailable, invalid
from elastrain.api.export_slots import ExportSlots
from elastrain.api.routes.jobs import MAX_INT32, JobId, _owned_job
from elastrain.checkpoints.catalog import CheckpointInfo
from elastrain.checkpoints.export import (
    EXPORTABLE,
    ExportError,
    pack_export,
    pick_checkpoint,
    remove_export,
)
from elastrain.contracts.datasets import DataPathError, resolve_data_path
from elastrain.contracts.runtime import ExportRequest
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.storage import JobStorage
from elastrain.service.launcher import Launcher
from elastrain.service.settings import Settings

log = logging.getLogger("elastrain.api.export")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: Where export tasks write, below the storage root (deleted once packed).
EXPORTS_FOLDER = "exports"


@router.get(
    "/{job_id}/export",
    summary="A committed checkpoint as a Hugging Face model folder (a tar)",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/x-tar": {}}, "description": "The model folder, a tar"},
        404: {"description": "No such job"},
        409: {
            "description": "No committed checkpoint (of that step), or one that cannot be "
            "exported (the reason says why)"
        },
        422: {"description": "Not an hf_causal_lm or gpt job, or an unknown format"},
        429: {"description": "Too many exports at once (Retry-After says when to retry)"},
        503: {"description": "This API process runs no scheduler, so reaches no cluster"},
    },
)
def export_job(
    request: Request,
    job_id: JobId,
    session: SessionDep,
    who: CurrentPrincipal,
    settings: SettingsDep,
    fmt: Annotated[
        Literal["hf"], Query(alias="format", description="hf: a Hugging Face model folder.")
    ] = "hf",
    step: Annotated[
        int | None, Query(ge=0, le=MAX_INT32, description="Which step (default: the newest).")
    ] = None,
) -> FileResponse:
    job = _owned_job(session, job_id, who)
    spec = JobSpec.from_stored(job.spec)
    owner = job.owner
    session.close()  # the conversion needs no DB connection
    workload = spec.workload.name
    if workload not in EXPORTABLE:
        raise invalid(
            ("query", "format"),
            f"format: {fmt} exports {' and '.join(EXPORTABLE)} jobs; job {job_id} trains "
            f"{workload or spec.workload.entrypoint}",
        )
    params = spec.workload.params
    storage = settings.storage_path
    folder = None
    if workload == "hf_causal_lm" and isinstance(params.get("model"), str):
        try:
            folder = resolve_data_path(params["model"], storage, owner)
        except DataPathError as exc:
            raise Conflict(f"workload.params.model: {exc}") from exc
    try:
        info = pick_checkpoint(JobStorage.of(storage, job_id).checkpoints, step)
    except ExportError as exc:
        raise Conflict(f"job {job_id}: {exc}") from exc
    launcher = _launcher(request)
    # Written by the task on the shared storage under a name nobody can guess, read back
    # as a job's bytes are (pack_export), then deleted.
    out = Path(EXPORTS_FOLDER, uuid.uuid4().hex, "model")
    work = Path(tempfile.mkdtemp(prefix="elastrain-export-"))
    try:
        with _slots(request, settings).slot(owner):
            outcome = launcher.export(
                ExportRequest(
                    job_id=job_id,
                    storage_path=str(storage),
                    checkpoint=str(info.path.relative_to(storage)),
                    workload=workload,
                    params_json=json.dumps(params),
                    out=str(out),
                    model_folder=str(folder.relative_to(storage)) if folder else "",
                )
            )
            if outcome.failed:  # the task's own words go to the server log only
                log.error(
                    "export of job %s, step %s failed: %s %s",
                    job_id, info.step, outcome.failed, outcome.details,
                )  # fmt: skip
                raise Conflict(f"job {job_id}, step {info.step}: {outcome.failed}")
            if outcome.refused:
                raise Conflict(f"job {job_id}, step {info.step}: {outcome.refused}")
            archive = work / "model.tar"
            pack_export(storage, storage / out, archive, max_bytes=_most_bytes(info))
    except ExportError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise Conflict(f"job {job_id}, step {info.step}: {exc}") from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        remove_export(storage, storage / out.parent)
    return FileResponse(
        archive,
        media_type="application/x-tar",
        filename=f"job-{job_id}-step-{info.step}-{fmt}.tar",
        headers={"X-Elastrain-Step": str(info.step)},
        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True),
    )


def _most_bytes(info: CheckpointInfo) -> int:
    """The most an export of `info` may write: its weights are a part of what the
    checkpoint holds, and the configs are small."""
    return max(info.manifest.total_bytes, sum(f["size"] for f in info.manifest.files.values())) + (
        64 << 20
    )


def _launcher(request: Request) -> Launcher:
    """The scheduler's launcher, through which the export task runs on the cluster."""
    running = request.app.state.scheduler
    if running is None:
        raise Unavailable(
            "exports run on the cluster, and this API process has no connection to it "
            "(it runs without the scheduler); ask the service that runs the scheduler"
        )
    launcher: Launcher = running.scheduler.launcher
    return launcher


def _slots(request: Request, settings: Settings) -> ExportSlots:
    """The app's export slots, made on first use from its settings."""
    slots: ExportSlots | None = getattr(request.app.state, "export_slots", None)
    if slots is None:
        slots = ExportSlots(
            total=settings.export_max_concurrent, per_tenant=settings.export_max_per_tenant
        )
        request.app.state.export_slots = slots
    return slots
