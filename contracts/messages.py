"""What crosses process boundaries at run time: worker -> driver -> scheduler.

Rank 0 of a worker group sends one `WorkerMessage` at a time to its attempt's driver (a
thread of the runtime actor; fire and forget). The driver numbers them and hands them to the scheduler in a
`DriverReport`; the scheduler persists them and acknowledges the highest number it has
committed, so a message is stored exactly once even when a pass rolls back or the control
plane restarts (the driver re-sends what was not acknowledged). Ray pickles these classes
by reference, so both ends import them from here, a module free of torch, ray and
sqlalchemy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    """What an event row records. Transitions are written by `service.jobs.set_job_state`;
    the rest are happenings around them."""

    TRANSITION = "transition"
    PLACEMENT = "placement"  # where the ranks of an attempt run
    NODE_LOST = "node_lost"
    WORKER_ERROR = "worker_error"
    RESUMED = "resumed"  # an attempt restored a checkpoint
    CHECKPOINT_FALLBACK = "checkpoint_fallback"  # a newer checkpoint was torn or corrupt
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    CANCEL_REQUESTED = "cancel_requested"
    BELOW_MIN = "below_min"  # fewer than min_workers fit: the job waits
    CAPACITY = "capacity"  # enough capacity again after a wait
    LAUNCH_FAILED = "launch_failed"
    TIMELINE = "timeline"  # where the seconds of a start, recovery or resize went
    PACKAGE = "package"  # the uploaded package an attempt's workers verified and import
    PLAN = "plan"  # which strategy an `auto` job runs at the world size it launches at


class DriverStatus(str, Enum):
    """Where an attempt's driver stands."""

    STARTING = "starting"  # worker group not yet training
    RUNNING = "running"  # at least one step taken in this attempt
    SUCCEEDED = "succeeded"  # reached max_steps
    STOPPED = "stopped"  # stopped on request after a checkpoint (resize)
    FAILED = "failed"  # the worker group raised
    LOST = "lost"  # the runtime no longer knows the attempt (it died and was restarted)

    @property
    def is_final(self) -> bool:
        return self in (
            DriverStatus.SUCCEEDED,
            DriverStatus.STOPPED,
            DriverStatus.FAILED,
            DriverStatus.LOST,
        )


class ErrorKind(str, Enum):
    """What kind of failure a `WorkerError` records, set where the error is made (the rank's
    process knows what it caught, the driver knows which process died or hung). The driver
    and the scheduler decide on this, never on the type name or the message text."""

    RAISED = "raised"  # the workload or the loop raised: maybe transient, retried
    CONFIGURATION = "configuration"  # the workload cannot be built from the spec: not retried
    PEER_LOST = "peer_lost"  # a collective failed because a peer went away: an echo, not a cause
    PROCESS_DIED = "process_died"  # the rank's process died (the driver saw it go)
    STUCK = "stuck"  # the rank did not return in the grace after another rank failed
    ABORTED = "aborted"  # the attempt was released while it ran
    DRIVER_LOST = "driver_lost"  # the runtime no longer knows the attempt
    GROUP_FAILED = "group_failed"  # the group failed and no rank said why
    BUSY = "busy"  # the process was still running another attempt


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerError:
    """Why an attempt failed, as a record rather than a string to re-parse."""

    type: str
    """The exception's class name (`ValueError`), for people; decisions read `kind`."""
    message: str
    """The most specific line of the exception's text."""
    rank: int | None = None
    node_id: str | None = None
    hostname: str | None = None
    pid: int | None = None
    step: int | None = None
    """The optimizer step the rank was on (None: before training started)."""
    traceback: str = ""
    kind: ErrorKind = ErrorKind.RAISED

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        kind: ErrorKind = ErrorKind.RAISED,
        rank: int | None = None,
        node_id: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        step: int | None = None,
        traceback: str = "",
    ) -> WorkerError:
        """The record of `exc`. Its message is the most specific line of the exception's
        text: the last non-blank one (a message that embeds a remote traceback ends with
        the root cause), or the type's name when the text is empty."""
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return cls(
            type=type(exc).__name__,
            message=lines[-1] if lines else type(exc).__name__,
            rank=rank,
            node_id=node_id,
            hostname=hostname,
            pid=pid,
            step=step,
            traceback=traceback,
            kind=kind,
        )

    @property
    def signature(self) -> str:
        """What makes two failures "the same error": neither the rank, the node nor the
        process, which differ from one attempt to the next."""
        return f"{self.type}: {self.message}"

    def summary(self) -> str:
        """One line for people: where it happened, then what."""
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.node_id:
            where.append(f"on node {self.node_id[:12]}")
        host = ", ".join(x for x in (self.hostname, f"pid {self.pid}" if self.pid else None) if x)
        prefix = " ".join(where) + (f" ({host})" if host else "")
        return f"{prefix}: {self.signature}" if prefix else self.signature

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "message": self.message,
            "rank": self.rank,
            "node_id": self.node_id,
            "hostname": self.hostname,
            "pid": self.pid,
            "step": self.step,
            "traceback": self.traceback,
            "kind": self.kind.value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerError:
        return cls(
            type=str(data.get("type") or "Error"),
            message=str(data.get("message") or ""),
            rank=data.get("rank"),
            node_id=data.get("node_id"),
            hostname=data.get("hostname"),
            pid=data.get("pid"),
            step=data.get("step"),
            traceback=str(data.get("traceback") or ""),
            kind=_kind_of(data),
        )


#: What rows stored before errors had a kind said in `type`.
_LEGACY_KINDS = {
    "WorkloadError": ErrorKind.CONFIGURATION,
    "WorkerDied": ErrorKind.PROCESS_DIED,
    "WorkerStuck": ErrorKind.STUCK,
    "Aborted": ErrorKind.ABORTED,
    "DriverLost": ErrorKind.DRIVER_LOST,
    "WorkerGroupError": ErrorKind.GROUP_FAILED,
    "WorkerBusy": ErrorKind.BUSY,
}


def _kind_of(data: dict[str, Any]) -> ErrorKind:
    """The stored kind; a row written before errors had one gets the kind its made-up type
    name stood for (else RAISED), so old failures still count as what they were."""
    stored = data.get("kind")
    if stored is not None:
        try:
            return ErrorKind(stored)
        except ValueError:
            return ErrorKind.RAISED
    return _LEGACY_KINDS.get(str(data.get("type")), ErrorKind.RAISED)


class Control(str, Enum):
    """What the scheduler asks of a running worker group through its driver. Rank 0 checks
    once per step and every rank acts on it at the same step."""

    NONE = "none"
    CHECKPOINT = "checkpoint"  # save a checkpoint after this step, keep going
    STOP = "stop"  # save a checkpoint after this step, then return (resize / preempt)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Which node and process holds each rank: the scheduler sees node loss from it."""

    nodes: dict[int, str]  # rank -> Ray node id
    pids: dict[int, int] = field(default_factory=dict)  # rank -> worker process id
    placement_group: str | None = None  # the worker group's placement group (hex id)

    def node_list(self) -> tuple[str, ...]:
        return tuple(self.nodes[r] for r in sorted(self.nodes))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One optimizer step. `values` holds loss, lr, step_time_s, samples_per_s,
    tokens_per_s, world_size, memory, batch_crc, wall_time (see workers.loop)."""

    step: int
    values: dict[str, Any]

    @classmethod
    def from_point(cls, point: dict[str, Any]) -> StepMetrics:
        """From the flat form `{"step": ..., "loss": ..., ...}` (`to_point`)."""
        return cls(step=int(point["step"]), values={k: v for k, v in point.items() if k != "step"})

    def to_point(self) -> dict[str, Any]:
        """The flat form, as saved in a checkpoint's manifest."""
        return {"step": self.step, **self.values}

    @property
    def loss(self) -> float | None:
        loss = self.values.get("loss")
        return None if loss is None else float(loss)

    @property
    def world_size(self) -> int | None:
        ws = self.values.get("world_size")
        return None if ws is None else int(ws)


class RestoreSource(str, Enum):
    """Where a resumed attempt took the job's state from."""

    CHECKPOINT = "checkpoint"
    PEER = "peer"  # a surviving worker's memory: no step since the last checkpoint is lost


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCommitted:
    """A checkpoint whose manifest is on disk (`checkpoints` commit protocol)."""

    step: int
    attempt: int
    world_size: int
    path: str
    bytes: int
    manifest: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    """The attempt restored the job's state before its first step: from a checkpoint, or
    from the memory of a worker that survived the previous attempt (`source`)."""

    step: int
    path: str
    """The checkpoint's folder; empty when the state came from a peer."""
    saved_world_size: int
    world_size: int
    saved_attempt: int = 0
    """The attempt that saved the checkpoint."""
    metrics: tuple[StepMetrics, ...] = ()
    """The steps before the checkpoint, as saved with it: the scheduler fills in those it
    never received (reports still in flight when their attempt was stopped)."""
    source: RestoreSource = field(default_factory=lambda: RestoreSource.CHECKPOINT)
    steps_recomputed: int | None = None
    """Steps the previous attempt had completed beyond `step`, to be trained again; None
    when no process of the previous attempt is in the group to say how far it got."""

    def describe(self) -> str:
        origin = (
            "peer memory" if self.source == RestoreSource.PEER else f"checkpoint step {self.step}"
        )
        redo = (
            f", {self.steps_recomputed} step(s) recomputed"
            if self.steps_recomputed is not None
            else ""
        )
        return (
            f"resumed from step {self.step} ({origin}; saved at world size "
            f"{self.saved_world_size}, now {self.world_size}{redo})"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEvent:
    """Something worth an event row that is not one of the messages above."""

    event: EventKind
    reason: str
    details: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFailed:
    error: WorkerError


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """Rank 0 returned from the loop."""

    final_step: int
    stopped_early: bool


class Phase(str, Enum):
    """The phases of a start, recovery or resize, in the order they happen."""

    DETECTED = "detected"  # the control plane decided: submitted, node lost, failed, resize
    OLD_GROUP_STOPPED = "old_group_stopped"  # the previous attempt's processes let go
    PLACED = "placed"  # resources reserved, a process chosen for every rank
    PROCESSES_UP = "processes_up"  # every rank's process answers (warm: at once)
    GROUP_FORMED = "group_formed"  # torch.distributed process group initialised
    STATE_RESTORED = "state_restored"  # from peer memory, a checkpoint, or a fresh start
    FIRST_STEP = "first_step"  # the first optimizer step of the attempt is done


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineMark:
    """One phase reached, at wall-clock `at` (rank 0 or the driver sends it)."""

    phase: Phase
    at: float
    detail: str = ""
    source: RestoreSource | None = None
    """Where STATE_RESTORED took the state from; None for a fresh start and other phases."""
    steps_recomputed: int | None = None
    """STATE_RESTORED: steps the previous attempt had done beyond the state restored (None:
    unknown, or another phase)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """Where the seconds of one attempt's start went, sent once, at its first step."""

    cause: str
    """Why the attempt started: "submitted", "node lost", "failed", "resize"."""
    marks: tuple[TimelineMark, ...]

    @property
    def total_s(self) -> float:
        return self.marks[-1].at - self.marks[0].at if self.marks else 0.0

    def phases(self) -> list[dict[str, Any]]:
        """Each phase with its seconds since the previous one and since detection."""
        if not self.marks:
            return []
        start = self.marks[0].at
        out, prev = [], start
        for mark in self.marks:
            out.append(
                {
                    "phase": mark.phase.value,
                    "at": mark.at,
                    "seconds": round(mark.at - prev, 3),
                    "since_start_s": round(mark.at - start, 3),
                    "detail": mark.detail,
                    "source": mark.source.value if mark.source is not None else None,
                    "steps_recomputed": mark.steps_recomputed,
                }
            )
            prev = mark.at
        return out

    def describe(self) -> str:
        steps = ", ".join(
            f"{p['phase'].replace('_', ' ')} +{p['seconds']:.2f}s" for p in self.phases()[1:]
        )
        return f"{self.cause} -> first step in {self.total_s:.2f}s ({steps})"


WorkerMessage = (
    Placement
    | StepMetrics
    | CheckpointCommitted
    | Resumed
    | WorkerEvent
    | WorkerFailed
    | Finished
    | TimelineMark
    | Timeline
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverReport:
    """What a driver tells the scheduler on a poll: its status and the messages after the
    sequence number the scheduler acknowledged."""

    status: DriverStatus
    messages: tuple[WorkerMessage, ...] = ()
    seq: int = 0
    """The sequence number of the last message in `messages` (the acknowledged one when
    there are none): the scheduler stores it with what it persisted and acknowledges it on
    the next poll."""
    error: WorkerError | None = None
    """Why the attempt ended, when it FAILED or was LOST."""
    placement: Placement | None = None
    """The latest placement, also when it was acknowledged before."""
    resumed_from_step: int | None = None
    """The checkpoint step this attempt restored (None: a fresh start, or not yet)."""
    stopping: bool = False
    """The driver has been asked to stop (and passes it on to the workers at their next
    step). False also when the driver did not answer: the scheduler then asks again."""

    @property
    def metrics(self) -> list[StepMetrics]:
        return [m for m in self.messages if isinstance(m, StepMetrics)]
