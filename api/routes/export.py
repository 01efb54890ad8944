"""`GET /v1/jobs/{id}/export`: a committed checkpoint as a Hugging Face model folder,
streamed as a tar (`config.json`, `model.safetensors`, `generation_config.json`);
`elastrain export JOB --format hf --out DIR` unpacks it.

The server converts: it is where the shared storage is, and it checks the caller may see
the job (another tenant's job is a 404, as everywhere). The conversion runs in a child
process (`elastrain.checkpoints.export.export_in_child`: the API never loads torch), which reads the
checkpoint's weights whole: the server's machine needs the `hf` extra, and memory for two
copies of the model's weights (the checkpoint's and the HF model's) while it runs, so
exports at once are bounded (`ExportSlots`: a 429 past them).

Every byte of the checkpoint is the job's to write: the child reads it as hostile input
(`elastrain.checkpoints.dcp.untrusted`: no pickle but DCP's metadata classes, no link
followed, allocations bounded by the bytes on disk), with an environment holding none of
the service's secrets. Whatever it refuses is a 409 naming the step, never a server path.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from elastrain.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from elastrain.api.errors import Conflict, invalid
from elastrain.api.export_slots import ExportSlots
from elastrain.api.routes.jobs import MAX_INT32, JobId, _owned_job
from elastrain.checkpoints.export import (
    EXPORTABLE,
    ExportError,
    ExportFailed,
    export_in_child,
    pick_checkpoint,
)
from elastrain.contracts.datasets import DataPathError, resolve_data_path
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.storage import JobStorage
from elastrain.service.settings import Settings

log = logging.getLogger("elastrain.api.export")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


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
    folder = None
    if workload == "hf_causal_lm" and isinstance(params.get("model"), str):
        try:
            folder = resolve_data_path(params["model"], settings.storage_path, owner)
        except DataPathError as exc:
            raise Conflict(f"workload.params.model: {exc}") from exc
    try:
        info = pick_checkpoint(JobStorage.of(settings.storage_path, job_id).checkpoints, step)
    except ExportError as exc:
        raise Conflict(f"job {job_id}: {exc}") from exc
    work = Path(tempfile.mkdtemp(prefix="elastrain-export-"))
    try:
        with _slots(request, settings).slot(owner):
            export_in_child(
                info.path, workload, params, work / "model",
                model_folder=folder, trusted_root=settings.storage_path,
            )  # fmt: skip
        archive = work / "model.tar"
        with tarfile.open(archive, "w") as tar:
            for path in sorted((work / "model").iterdir()):
                tar.add(path, arcname=path.name)
    except ExportError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise Conflict(f"job {job_id}, step {info.step}: {exc}") from exc
    except ExportFailed as exc:  # the child's own words go to the server log only
        shutil.rmtree(work, ignore_errors=True)
        log.error("export of job %s, step %s failed: %s", job_id, info.step, exc.details)
        raise Conflict(f"job {job_id}, step {info.step}: {exc}") from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return FileResponse(
        archive,
        media_type="application/x-tar",
        filename=f"job-{job_id}-step-{info.step}-{fmt}.tar",
        headers={"X-Elastrain-Step": str(info.step)},
        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True),
    )


def _slots(request: Request, settings: Settings) -> ExportSlots:
    """The app's export slots, made on first use from its settings."""
    slots: ExportSlots | None = getattr(request.app.state, "export_slots", None)
    if slots is None:
        slots = ExportSlots(
            total=settings.export_max_concurrent, per_tenant=settings.export_max_per_tenant
        )
        request.app.state.export_slots = slots
    return slots
