"""Submission policy: what a spec must pass, for its tenant, before it is stored.

`submit` is the one entry point (the `POST /v1/jobs` route calls it): the code the job runs
exists and may run, its data files exist in the tenant's area, an `auto` job fits the
workers, its trackers are the operator's to allow, the tenant's queue has room, and a
script has an OS identity to run as. The checks run in that order and the first that
fails refuses the job: `SpecRefused` (each problem names the spec field to fix; the API
answers 422) or `QueueFull` (429). The decisions are pure functions of what the checks
read from the database, the storage root and the settings; this module reads, and leaves
committing to the caller.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row
from sqlalchemy.orm import Session

from elastrain.contracts.bounds import entrypoint_refusal, in_standard_library, private_part
from elastrain.contracts.datasets import data_path_problems
from elastrain.contracts.os_identity import RunAs
from elastrain.contracts.packages import OWN_PACKAGES, Manifest, modules_of
from elastrain.contracts.plan import AUTO_CHOICES, plan, shape_of
from elastrain.contracts.prepared import prepare_problems
from elastrain.contracts.spec import JobSpec, StrategyKind
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams, PrepareParams
from elastrain.service import cluster, package_access
from elastrain.service.auth import Principal
from elastrain.service.jobs import insert_job, queued_jobs
from elastrain.service.packages import load_manifest, touch
from elastrain.service.settings import Settings
from elastrain.service.tracking import missing_clients
from elastrain.service.tracking.destinations import Origin, mlflow_uri_problem

#: Where a full queue's submitter is told to try again (seconds).
QUEUE_RETRY_AFTER_S = 30

Field = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One reason the spec cannot run: the spec field (`("workload", "entrypoint")`) and
    a message that starts with its dotted name."""

    field: Field
    message: str


class SpecRefused(Exception):
    """The spec cannot run here, for reasons its own validation could not see (they need
    the database, the storage root or the settings)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = tuple(problems)


class QueueFull(Exception):
    """The tenant has as many jobs waiting as it may; `retry_after_s`: when to try again."""

    def __init__(self, message: str, *, retry_after_s: int = QUEUE_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def submit(session: Session, spec: JobSpec, who: Principal, settings: Settings) -> Row[Any]:
    """Check `spec` for `who` and store it as a new PENDING job (not committed): its row,
    every column (`elastrain.service.jobs.insert_job`).

    Raises SpecRefused or QueueFull, naming what to change. A package the job runs is
    marked in use as soon as it is found (retention counts from now).
    """
    _check_workload_code(spec, settings, session, who)
    _refuse(_data_problems(spec, settings.storage_path, who.tenant))
    _refuse(auto_problems(spec, _worker_memory(spec, session, settings)))
    _refuse(
        tracker_problems(
            spec,
            allowed=settings.allowed_trackers,
            operator_uri=settings.mlflow_tracking_uri,
            missing=missing_clients(spec),
        )
    )
    limit = settings.max_queued_jobs_per_tenant
    if queue_is_full(queued_jobs(session, who.tenant), limit):
        raise QueueFull(
            f"your tenant has {limit} jobs waiting in the queue, the most it may "
            "(ELASTRAIN_MAX_QUEUED_JOBS_PER_TENANT); submit again when some have started"
        )
    mapping_on = bool(settings.tenant_users)
    identities = settings.tenant_identities
    _refuse(identity_problems(spec, who.tenant, mapping_on=mapping_on, identities=identities))
    return insert_job(session, spec=spec, owner=who.tenant)


def _refuse(problems: Sequence[Problem]) -> None:
    if problems:
        raise SpecRefused(problems)


# ---------------------------------------------------------------------------------------
# The code the job runs
# ---------------------------------------------------------------------------------------


def _check_workload_code(
    spec: JobSpec, settings: Settings, session: Session, who: Principal
) -> None:
    """The code the job will run exists and may run: an installed module the operator
    allows, or a module inside the job's uploaded package (which the operator's list does
    not restrict: it is the tenant's own code, shipped with the job), or a command's
    script inside its package. Another tenant's package is refused with the words used for
    a digest nobody uploaded."""
    workload = spec.workload
    if workload.command is not None:
        if workload.package is None:
            return  # runs a module or a program the workers have: nothing uploaded to check
        manifest = _visible_package(workload.package, settings, session, who)
        _refuse(script_problems(workload.script_file, workload.package, manifest))
        touch(settings.storage_path, workload.package)
        return
    if workload.package is None or workload.entrypoint is None:
        _refuse(entrypoint_problems(workload.entrypoint, settings.allowed_entrypoints))
        return
    _refuse(private_problems(workload.entrypoint))
    manifest = _visible_package(workload.package, settings, session, who)
    _refuse(package_module_problems(workload.entrypoint, workload.package, manifest))
    touch(settings.storage_path, workload.package)  # in use: retention counts from now


def _visible_package(digest: str, settings: Settings, session: Session, who: Principal) -> Manifest:
    """The package's manifest, when it exists and is the caller's to use; else the one
    refusal for both (another tenant's package reads as a missing one)."""
    manifest = load_manifest(settings.storage_path, digest)
    if manifest is None or not package_access.visible(session, digest, who):
        raise SpecRefused([missing_package(digest)])
    return manifest


def missing_package(digest: str) -> Problem:
    return Problem(
        ("workload", "package"),
        f"workload.package: no package {digest} on this service; upload the "
        "directory first (POST /v1/packages, or `elastrain submit --working-dir DIR`)",
    )


def entrypoint_problems(entrypoint: str | None, allowed_prefixes: Sequence[str]) -> list[Problem]:
    """An installed module's entrypoint is one the operator allows (a built-in: None)."""
    if (
        entrypoint is None
        or (why := entrypoint_refusal(entrypoint, list(allowed_prefixes))) is None
    ):
        return []
    return [Problem(("workload", "entrypoint"), f"workload.entrypoint: {why}")]


def private_problems(entrypoint: str) -> list[Problem]:
    """Only public factories run, from a package as from anywhere."""
    if (private := private_part(entrypoint)) is None:
        return []
    return [
        Problem(
            ("workload", "entrypoint"),
            f"workload.entrypoint: {private!r} is private (it starts with '_'); only public "
            "factories can run",
        )
    ]


def package_module_problems(entrypoint: str, package: str, manifest: Manifest) -> list[Problem]:
    """The entrypoint's module is in the package, under a name that shadows nothing the
    workers import themselves."""
    module = entrypoint.partition(":")[0]
    where = ("workload", "entrypoint")
    if in_standard_library(module) or module.split(".")[0] in OWN_PACKAGES:
        return [
            Problem(
                where,
                f"workload.entrypoint: module {module!r} has the name of a standard-library "
                "or elastrain module; rename it in your package",
            )
        ]
    if not manifest.has_module(module):
        have = ", ".join(modules_of(f.path for f in manifest.files)[:20]) or "none"
        return [
            Problem(
                where,
                f"workload.entrypoint: module {module!r} is not in package {package} "
                f"(its modules: {have})",
            )
        ]
    return []


def script_problems(script: str | None, package: str, manifest: Manifest) -> list[Problem]:
    """A command's script is a file of its package (a typo is refused now, not a failed
    job later)."""
    paths = {f.path for f in manifest.files}
    if script is None or script.removeprefix("./") in paths:
        return []
    have = ", ".join(sorted(paths)[:20]) or "none"
    return [
        Problem(
            ("workload", "command"),
            f"workload.command: {script!r} is not in package {package} (its files: {have})",
        )
    ]


# ---------------------------------------------------------------------------------------
# Data, placement, trackers, queue, identity
# ---------------------------------------------------------------------------------------


def _data_problems(spec: JobSpec, storage_root: pathlib.Path, owner: str) -> list[Problem]:
    """A built-in gpt's (or hf_causal_lm's) data files exist in the owner's data area (or
    the shared one) and can make windows; an hf_causal_lm's model folder has a config."""
    params: GptParams | HfCausalLmParams
    if spec.workload.name == "gpt":
        params = GptParams.model_validate(spec.workload.params)
    elif spec.workload.name == "hf_causal_lm":
        params = HfCausalLmParams.model_validate(spec.workload.params)
    elif spec.workload.name == "prepare":
        prepare = PrepareParams.model_validate(spec.workload.params)
        return problems_at_their_fields(prepare_problems(prepare, storage_root, owner))
    else:
        return []
    return problems_at_their_fields(data_path_problems(params, storage_root, owner))


def problems_at_their_fields(messages: Sequence[str]) -> list[Problem]:
    """Messages that start with their field's dotted name (`workload.params.data_path:
    ...`) as problems at that field."""
    return [Problem(tuple(m.partition(":")[0].split(".")), m) for m in messages]


def _worker_memory(spec: JobSpec, session: Session, settings: Settings) -> int | None:
    """What one worker of an `auto` job has to hold its part (None: not known now): the
    operator's figure, else, on CPU workers, what the cluster reports."""
    if spec.strategy.kind != StrategyKind.auto:
        return None
    memory = settings.worker_memory_bytes
    if memory is None and not spec.scaling.use_gpu:
        snapshot = cluster.current(session)
        memory = cluster.worker_memory_bytes(snapshot, spec.scaling.cpus_per_worker)
    return memory


def auto_problems(spec: JobSpec, worker_memory: int | None) -> list[Problem]:
    """An `auto` job must fit at some world size in min..max (tensor-parallel degrees need
    sizes they divide), when the workers' memory is known (else it is planned at launch,
    against what the cluster then says). The problem carries the plan's numbers at
    max_workers."""
    if spec.strategy.kind != StrategyKind.auto:
        return []
    shape = shape_of(spec)
    if worker_memory is None or shape is None:
        return []
    for size in reversed(spec.world_sizes):
        if plan(shape, spec, size, worker_memory, eligible=AUTO_CHOICES).chosen is not None:
            return []
    made = plan(shape, spec, spec.scaling.max_workers, worker_memory, eligible=AUTO_CHOICES)
    return [Problem(("strategy", "kind"), f"strategy.kind: auto: {made.why}")]


def tracker_problems(
    spec: JobSpec,
    *,
    allowed: Sequence[Origin],
    operator_uri: str | None,
    missing: Mapping[str, str],
) -> list[Problem]:
    """Each tracker the spec names is one the operator allows (its destination: see
    `elastrain.service.tracking.destinations`) and has its client installed on the control
    plane (`missing`: tracker -> the extra that installs it), which is what forwards to it
    (the workers never do)."""
    if spec.tracking.mlflow is not None:
        problem = mlflow_uri_problem(
            spec.tracking.mlflow.tracking_uri, allowed=list(allowed), operator_uri=operator_uri
        )
        if problem is not None:
            return [Problem(("tracking", "mlflow", "tracking_uri"), problem)]
    return [
        Problem(
            ("tracking", name),
            f"tracking.{name}: install {extra} on the control plane (the service forwards "
            f"to {name}; its client package is missing)",
        )
        for name, extra in missing.items()
    ]


def queue_is_full(queued: int, limit: int) -> bool:
    """A tenant's queue is bounded: every PENDING job is decided on every scheduler pass
    (admission sorts the whole queue), so one tenant's flood would slow every job's
    recovery."""
    return queued >= limit


def identity_problems(
    spec: JobSpec, tenant: str, *, mapping_on: bool, identities: Mapping[str, RunAs]
) -> list[Problem]:
    """While the operator maps tenants to OS identities (`mapping_on`), a tenant without
    one runs no script (it would run as the workers' user, beside every other tenant's
    files)."""
    if not spec.workload.command or not mapping_on or tenant in identities:
        return []
    return [
        Problem(
            ("workload", "command"),
            f"workload.command: tenant {tenant!r} has no OS identity to run scripts as "
            "(the operator's ELASTRAIN_TENANT_USERS); use a built-in workload",
        )
    ]
