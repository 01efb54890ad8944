"""HTTP response models. ORM rows live in `service/models.py`; these shape what clients see.

Routes validate ORM objects or Core rows (the hot submit and get-by-id paths) into these
models with `from_attributes` and serialise them once, straight into their JSON shape.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    AliasPath,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    computed_field,
)

from elastrain.contracts.bounds import no_control_characters
from elastrain.contracts.spec import JobSpec
from elastrain.service import goodput
from elastrain.service.models import utcnow
from elastrain.service.states import JobState


class _FromRow(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class JobOut(_FromRow):
    # `validate_by_name`: tests and clients may build one from plain dicts with `labels=`.
    model_config = ConfigDict(from_attributes=True, validate_by_name=True)

    id: int
    name: str
    owner: str
    spec: dict[str, Any] = Field(
        description="The job spec as accepted (see the JobSpec schema), defaults filled in."
    )
    state: JobState
    state_reason: str | None
    priority: int
    strategy: str = Field(
        description="The strategy the current attempt runs: the spec's, or for `auto` what "
        "the memory plan chose at its launch ('auto' before the first)."
    )
    attempt: int = Field(description="The current attempt; 0 before the first launch.")
    restarts: int
    world_size: int | None = Field(description="Workers of the current attempt, if running.")
    step: int = Field(description="The newest training step reported.")
    max_steps: int
    latest_loss: float | None
    cancel_requested: bool
    checkpoint_requested: bool
    # From the spec, not the `job_labels` table: same data, no second query per job.
    labels: dict[str, str] = Field(
        default_factory=dict, validation_alias=AliasChoices(AliasPath("spec", "labels"), "labels")
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_error: str | None
    # The goodput inputs, kept on the row; shown as `goodput`, not themselves.
    seconds_in: dict[str, float] | None = Field(default=None, exclude=True)
    state_since: datetime | None = Field(default=None, exclude=True)
    compute_s: float | None = Field(default=None, exclude=True)
    kept_s: float | None = Field(default=None, exclude=True)
    stall_s: float | None = Field(default=None, exclude=True)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def goodput(self) -> GoodputOut:
        split = goodput.of_job(self, now=utcnow())
        return GoodputOut.model_validate(split.to_dict())


class GoodputOut(BaseModel):
    """Where the job's wall time went (seconds), and `goodput`: the share spent on training
    steps the job kept. See `service/goodput.py` for what each bucket holds."""

    wall_s: float
    queued_s: float
    starting_s: float
    training_s: float = Field(description="Steps whose results the job kept.")
    recomputed_s: float = Field(description="Steps lost to a failure and computed again.")
    recovering_s: float
    resizing_s: float
    checkpoint_stall_s: float
    other_s: float
    goodput: float | None = Field(description="training_s / wall_s (null at wall_s 0).")


class JobList(BaseModel):
    items: list[JobOut]
    total: int = Field(description="Jobs matching the filters, over all pages.")
    limit: int
    offset: int


class EventOut(_FromRow):
    id: int
    at: datetime
    kind: str = Field(description="'transition' for a state change, else what happened.")
    from_state: JobState | None
    to_state: JobState | None
    reason: str
    world_size_before: int | None
    world_size_after: int | None
    attempt: int
    step: int | None
    details: dict[str, Any] | None


class MetricOut(BaseModel):
    """One training step; the reported values (loss, lr, tokens_per_s...) sit beside `step`."""

    model_config = ConfigDict(extra="allow")

    step: int
    attempt: int
    at: datetime


class CheckpointOut(_FromRow):
    step: int
    attempt: int
    world_size: int
    bytes: int
    path: str
    committed_at: datetime


class LogChunk(BaseModel):
    text: str = Field(description="New log text since `offset` (empty when there is none yet).")
    next_offset: str = Field(description="Pass back as `offset` to read on from here.")
    attempt: int | None = Field(description="The attempt whose logs these are.")
    latest_attempt: int | None = Field(description="The newest attempt that has logs.")
    files: list[str] = Field(description="Log files of that attempt, relative to the job's logs.")


class Health(BaseModel):
    status: str
    database: str
    scheduler: bool


# --- tenants and tokens -----------------------------------------------------------------

TenantName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"),
]


class Me(BaseModel):
    tenant: str
    admin: bool
    auth: bool = Field(description="Whether this service requires tokens at all.")


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: TenantName = Field(description="Whose token: its jobs are the tenant's.")
    admin: bool = Field(default=False, description="Sees and acts on every tenant's jobs.")
    name: Annotated[
        str, StringConstraints(max_length=100), AfterValidator(no_control_characters)
    ] = Field(default="", description="What it is for (shown by `token list`).")


class TokenOut(_FromRow):
    id: int
    tenant: str
    admin: bool
    name: str
    prefix: str = Field(description="The token's first characters, to recognise it.")
    created_at: datetime
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The token. Shown once: the service keeps only its hash.")


class TenantQuota(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_workers: int | None = Field(
        ge=1, le=1_000_000, description="Most workers its jobs may hold at once (null: default)."
    )


class TenantOut(BaseModel):
    name: str
    max_workers: int | None = Field(description="Its own quota (null: the default applies).")
    quota: int | None = Field(description="The quota in force (null: none).")
    workers_in_use: int


class PackageFileOut(BaseModel):
    path: str
    size: int


class PackageGrantOut(BaseModel):
    """Who may use a package: its uploader, or a tenant an admin shared it with."""

    tenant: str = Field(description="The tenant, or '*' for every tenant.")
    uploaded: bool = Field(description="It uploaded the package (else an admin shared it).")
    size_bytes: int = Field(description="What the upload counts against its storage quota.")
    granted_by: str = Field(description="Whose token uploaded or shared it.")
    created_at: datetime


class PackageOut(BaseModel):
    """A stored working directory (`POST /v1/packages`); `digest` goes in `workload.package`."""

    digest: str = Field(description="'sha256:' + hex: what `workload.package` names.")
    file_count: int
    size_bytes: int
    files: list[PackageFileOut]
    grants: list[PackageGrantOut] | None = Field(
        default=None, description="Admins only: who may use it (uploaders and shares)."
    )


class PackageShare(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: TenantName | Literal["*"] = Field(
        description="The tenant that may use the package from now on; '*': every tenant."
    )


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    device_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        le=2**50,
        description="Memory one worker has (a GPU's, or its share of host RAM); unset: the "
        "CPU share of the poorest node in the cluster view (GPU jobs must give it).",
    )
    world_size: int | None = Field(
        default=None, ge=1, le=1024, description="Only this world size (default: min..max)."
    )


class RankMemoryOut(BaseModel):
    strategy: str
    params: int
    grads: int
    optimizer: int
    extra: int
    activations: int
    total: int
    fits: bool
    note: str


class WorldSizePlan(BaseModel):
    world_size: int
    choice: str | None
    why: str
    rows: list[RankMemoryOut]


class PlanOut(BaseModel):
    device_memory_bytes: int
    usable_bytes: int
    memory_source: str
    params: int
    plans: list[WorldSizePlan]


#: A drain's deadline may be at most this far ahead (a week): a typo of minutes as
#: seconds is caught, a real maintenance window is not refused.
MAX_DRAIN_DEADLINE_S = 7 * 86400


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DRAIN_DEADLINE_S,
        description="Seconds until the node goes. A job that cannot leave it (its "
        "min_workers do not fit elsewhere) checkpoints and stops by then; without one it "
        "trains on there until undrain.",
    )
    reason: Annotated[
        str, StringConstraints(max_length=500), AfterValidator(no_control_characters)
    ] = Field(default="", description="Why (shown in /v1/cluster and the dashboard).")


class NodeDrainOut(BaseModel):
    node_id: str
    reason: str
    deadline: datetime | None = Field(description="When the node goes (null: no deadline).")
    source: str = Field(description="admin (elastrain drain), ray (Ray's drain API) or preemption.")
    created_by: str = ""
    created_at: datetime | None = None
