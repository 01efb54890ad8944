"""What the control plane and the runtime (`elastrain.workers.runtime`) say to each other.

The control plane launches an attempt once (`LaunchRequest`, after its DB transaction
committed) and then, once per scheduler pass, hands the runtime every attempt the database
says is live (`Reconcile`). The runtime answers with their reports and lets go of
everything else it holds: drivers, processes' job state, placement groups. So a release
call that fails, a control plane restarted on a database restored from backup, or a fresh
database converge at the next pass; nothing depends on one call getting through.

Plain data, pickled by Ray by reference: both ends import it from here.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from elastrain.contracts.messages import DriverReport
from elastrain.contracts.spec import JobSpec

#: The runtime actor's name in the service's Ray namespace.
RUNTIME_NAME = "elastrain-runtime"


class JobRef(NamedTuple):
    """A job of one database: job ids start at 1 in every database, and a runtime may
    hold state of a database the control plane no longer uses (a fresh one, after a
    restore) that must never be taken for this database's job of the same id."""

    database: str
    """`elastrain.service.identity`: a random id the database got when its schema was made."""
    job_id: int


class AttemptKey(NamedTuple):
    """One attempt of one job: the one shape of the attempt key, on both sides."""

    job_id: int
    attempt: int


def attempt_name(job_id: int, attempt: int) -> str:
    """The attempt's name, stored with it in the database and given to its driver and its
    placement group. The random part tells a database's attempt (1, 1) from another
    database's (1, 1): a control plane started on a fresh or restored database must not
    adopt the workers of an attempt it never launched."""
    return f"elastrain-job{job_id}-a{attempt}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchRequest:
    job_id: int
    attempt: int
    world_size: int
    spec: JobSpec
    storage_path: str
    name: str
    """`attempt_name`: what the database stored for this attempt."""
    database: str = ""
    """The database the job is stored in (`JobRef.database`)."""
    cause: str = "submitted"
    """Why this attempt starts: "submitted", "node lost", "failed", "resize"."""
    detected_at: float = 0.0
    """When the control plane decided it (wall clock; 0: now): where its timeline starts."""
    joined_at: float = 0.0
    """A grow onto a node that joined during the previous attempt: when the node joined
    (wall clock; 0: none). Its timeline starts there instead (`Phase.NODE_JOINED`)."""
    warm_at: float = 0.0
    """That grow: when the joined node's first process was warm (0: not known)."""
    avoid_nodes: tuple[str, ...] = ()
    """Ray node ids of draining nodes: no rank of this attempt is placed on them."""
    tenant: str = ""
    """The job's owner."""
    run_as: str = ""
    """`uid:gid` a `workload.command` script runs as (`contracts.os_identity`, the
    operator's map of tenants); "" runs it as the worker's own user."""
    sent_at: float = 0.0
    """When the control plane sent it, after the attempt was committed (its wall clock, as
    `Reconcile.observed_at`)."""

    @property
    def key(self) -> AttemptKey:
        return AttemptKey(self.job_id, self.attempt)

    @property
    def job(self) -> JobRef:
        return JobRef(self.database, self.job_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveAttempt:
    """An attempt the database says is live, as the runtime should hold it."""

    name: str
    """The attempt's name in the database: a driver of another name under the same key
    belongs to another database's attempt and is released."""
    ack: int = 0
    """The last message sequence number the control plane has stored."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconcile:
    """The control plane's view, handed to the runtime once per pass."""

    database: str = ""
    """The control plane's database (`JobRef.database`): state of any other's jobs goes."""
    attempts: dict[AttemptKey, LiveAttempt] = field(default_factory=dict)
    keep_jobs: frozenset[int] = frozenset()
    """Unfinished jobs (live or between attempts): processes keep these jobs' state for
    their next attempt and drop every other job's."""
    observed_at: float = 0.0
    """Wall clock just before the database was read. An attempt launched after it may be
    missing from `attempts` without being over (another scheduler that took the lease
    meanwhile launched it): only attempts launched before it are released for being
    absent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconciled:
    """The runtime's answer: a report per asked-for attempt (None: it does not hold that
    attempt) and what it let go of because the control plane no longer wants it."""

    reports: dict[AttemptKey, DriverReport | None] = field(default_factory=dict)
    released: tuple[str, ...] = ()
    """Names of the attempts (drivers) released for not being live."""
    forgotten_jobs: tuple[JobRef, ...] = ()
    """Jobs whose state processes dropped for not being unfinished."""
    removed_groups: tuple[str, ...] = ()
    """Placement groups removed that no live attempt owned."""
    ready_nodes: frozenset[str] | None = None
    """The alive nodes (as of the pool's last upkeep) where a rank can start without
    waiting for a process to start: one of the pool's has answered there, or the pool keeps
    none there. None: not known (an older runtime)."""
    warm_at: dict[str, float] = field(default_factory=dict)
    """Of the ready nodes where a pool process answered: when the first of those there had
    its imports done (the process's wall clock)."""


#: Where a node's preemption notice is kept in Ray's KV store (namespace, key prefix): the
#: node's watcher (`elastrain.workers.runtime.notice`) writes it, the control plane reads its reason.
NOTICE_KV_NAMESPACE = "elastrain"
NOTICE_KV_PREFIX = "preemption/"


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionNotice:
    """A cloud's notice that a node is about to be taken away."""

    node_id: str
    reason: str
    deadline: float | None
    """When the node goes (epoch seconds); None: the notice did not say."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PreemptionNotice:
        data = json.loads(raw)
        deadline = data.get("deadline")
        return cls(
            node_id=str(data["node_id"]),
            reason=str(data.get("reason", "")),
            deadline=float(deadline) if deadline is not None else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportRequest:
    """Convert one committed checkpoint into a model folder, on the cluster (the API reads
    none of a job's checkpoint: `elastrain.workers.export_task`). Paths are relative to
    the storage root, which the task enters without following a link."""

    job_id: int
    storage_path: str
    checkpoint: str
    """The step's folder, e.g. `jobs/7/checkpoints/step_00000040-a1`."""
    workload: str
    params_json: str
    """The workload's params, as JSON."""
    out: str
    """The folder the task makes and writes, e.g. `exports/<random>/model`."""
    model_folder: str = ""
    """An `hf_causal_lm` job's model folder (in its tenant's data area), or ""."""
    timeout_s: float = 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportOutcome:
    """What an export task says: nothing (made), a reason it refused (the checkpoint
    cannot be exported: for the caller), or that it failed otherwise (`details`, for the
    server's log only)."""

    refused: str = ""
    failed: str = ""
    details: str = ""
