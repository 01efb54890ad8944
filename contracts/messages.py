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

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any


class EventKind(str, Enum):
    """What an event row records. Transitions are written by `elastrain.service.jobs.set_job_state`;
    the rest are happenings around them."""

    TRANSITION = "transition"
    PLACEMENT = "placement"  # where the ranks of an attempt run
    NODE_LOST = "node_lost"
    NODE_DRAINING = "node_draining"  # a node of the attempt is going away: the job leaves it
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
    TRACKING = "tracking"  # forwarding to an experiment tracker failed (or recovered)
    FOLDER_SET_ASIDE = "folder_set_aside"  # something at the job's path predated the job
    LIMIT = "limit"  # a job put more into shared state than a limit allows: the rest dropped
    STRAGGLER = "straggler"  # a rank's local work is slower than its peers' (failure.stragglers)


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
    NODE_DIED = "node_died"  # the process died with its node (its raylet is gone): a node loss
    STUCK = "stuck"  # the rank did not return in the grace after another rank failed
    ABORTED = "aborted"  # the attempt was released while it ran
    DRIVER_LOST = "driver_lost"  # the runtime no longer knows the attempt
    GROUP_FAILED = "group_failed"  # the group failed and no rank said why
    BUSY = "busy"  # the process was still running another attempt
    HANG = "hang"  # a rank made no progress past the job's hang threshold (the runtime saw it)


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
    # Return after this step without a checkpoint: the group leaves a draining node, and
    # the next attempt takes the state from the survivors' memory (no save to wait for).
    LEAVE = "leave"


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Which node and process holds each rank: the scheduler sees node loss from it."""

    nodes: dict[int, str]  # rank -> Ray node id
    pids: dict[int, int] = field(default_factory=dict)  # rank -> worker process id
    placement_group: str | None = None  # the worker group's placement group (hex id)

    def node_list(self) -> tuple[str, ...]:
        return tuple(self.nodes[r] for r in sorted(self.nodes))


#: A number a workload reports beside the built-in ones (`StepMetrics.custom`).
Number = float | int


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One optimizer step as rank 0 measured it (`elastrain.workers.step_metrics`).

    Stored flat (`to_values`: the metric table's JSON column, a checkpoint manifest's
    points, the API's rows), where every reader but this class sees plain names. A float
    that was not finite is stored as null (`finite`): JSON has no NaN."""

    step: int
    loss: float | None
    wall_time: float = field(default_factory=time.time)
    """When the step finished (wall clock): recovery and growth times are measured from
    it, not from when the scheduler happened to store the point."""
    world_size: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    lr: float | None = None
    step_time_s: float | None = None
    checkpoint_stall_s: float = 0.0
    """The checkpoint save that blocked training just before this step (0: none)."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    model_flops_per_s: float | None = None
    """Model FLOPs per second per rank (`elastrain.workers.flops`)."""
    mfu: float | None = None
    """`model_flops_per_s` over the device's peak."""
    mfu_basis: str | None = None
    """Where the peak comes from, or why there is no MFU: on an attempt's first step only."""
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes per kind (param_bytes, grad_bytes, optimizer_bytes, activation_bytes,
    rss_bytes...), per rank: the strategy says which kinds it has."""
    batch_crc: int | None = None
    """A checksum of the step's global batch: equal curves are checked step by step."""
    eval_loss: float | None = None
    custom: dict[str, Number | None] = field(default_factory=dict)
    """What the workload reported beside these, by its own names (a built-in name wins)."""

    @classmethod
    def from_point(cls, point: Mapping[str, Any]) -> StepMetrics:
        """From the flat form (`to_point`); names this class does not have go to `custom`."""
        known = {k: v for k, v in point.items() if k in _BUILT_IN and k != "loss"}
        custom = {k: v for k, v in point.items() if k not in _BUILT_IN and k != "step"}
        if known.get("wall_time") is None:
            known.pop("wall_time", None)  # made now, like a point without one
        known["memory"] = dict(known.get("memory") or {})
        return cls(step=int(point["step"]), loss=point.get("loss"), custom=custom, **known)

    def to_values(self) -> dict[str, Any]:
        """The flat form without the step (a metric row's `values`): the fields that are
        set, `loss` always (null when it was not finite), custom names after built-in ones."""
        values: dict[str, Any] = {k: v for k, v in self.custom.items() if k not in _BUILT_IN}
        for name in _BUILT_IN:
            value = getattr(self, name)
            if (value is not None and value != {}) or name == "loss":
                values[name] = value
        return values

    def to_point(self) -> dict[str, Any]:
        """The flat form with the step, as saved in a checkpoint's manifest."""
        return {"step": self.step, **self.to_values()}

    def finite(self) -> StepMetrics:
        """This point with every float that is not finite (a diverged loss) as None:
        PostgreSQL's JSON refuses NaN, so one such point would fail every transaction
        that stores its report. The chart shows a gap."""
        changed: dict[str, Any] = {
            name: None
            for name in _FLOATS
            if isinstance(getattr(self, name), float) and not math.isfinite(getattr(self, name))
        }
        if any(isinstance(v, float) and not math.isfinite(v) for v in self.custom.values()):
            changed["custom"] = {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in self.custom.items()
            }
        return replace(self, **changed) if changed else self


_BUILT_IN = tuple(f.name for f in fields(StepMetrics) if f.name not in ("step", "custom"))
_FLOATS = tuple(
    f.name for f in fields(StepMetrics) if "float" in str(f.type) and f.name != "wall_time"
)


class RestoreSource(str, Enum):
    """Where a resumed attempt took the job's state from."""

    CHECKPOINT = "checkpoint"
    PEER = "peer"  # a surviving worker's memory: no step since the last checkpoint is lost


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedTraining:
    """What the training loop keeps in a checkpoint manifest's `extra` beside the tensors
    (`elastrain.checkpoints.manifest.Manifest.extra` is free-form: this is its one writer's shape)."""

    seed: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    save_started_at: float | None = None
    """With the manifest's commit time (`created_at`): the save's seconds."""
    metrics: tuple[StepMetrics, ...] = ()
    """The newest points, and every one not known to have reached the service: a resume
    hands back those the service never stored."""

    def to_extra(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "save_started_at": self.save_started_at,
            _POINTS: [m.to_point() for m in self.metrics],
        }

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SavedTraining:
        """Lenient: a manifest written before a field existed reads as without it."""
        extra = extra or {}

        def number(name: str, kind: type[int] | type[float]) -> Any:
            value = extra.get(name)
            return kind(value) if isinstance(value, int | float) else None

        return cls(
            seed=number("seed", int),
            global_batch_size=number("global_batch_size", int),
            micro_batch_size=number("micro_batch_size", int),
            save_started_at=number("save_started_at", float),
            metrics=tuple(StepMetrics.from_point(p) for p in extra.get(_POINTS) or ()),
        )

    @staticmethod
    def without_points(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
        """A manifest as catalogued: without the metric points it carries (they are in the
        metrics table already; a resume hands back the ones that were not)."""
        extra = (manifest or {}).get("extra")
        if not manifest or not isinstance(extra, dict) or _POINTS not in extra:
            return manifest
        return {**manifest, "extra": {k: v for k, v in extra.items() if k != _POINTS}}


_POINTS = "metrics"


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

    # A grow onto a node that joined: its timeline starts there (`JOIN_PHASES`).
    NODE_JOINED = "node_joined"  # the control plane first saw the node alive
    PROCESS_WARM = "process_warm"  # its first pool process had its imports done
    DETECTED = "detected"  # the control plane decided: submitted, node lost, failed, resize
    OLD_GROUP_STOPPED = "old_group_stopped"  # the previous attempt's processes let go
    PLACED = "placed"  # resources reserved, a process chosen for every rank
    PROCESSES_UP = "processes_up"  # every rank's process answers (warm: at once)
    GROUP_FORMED = "group_formed"  # torch.distributed process group initialised
    STATE_RESTORED = "state_restored"  # from peer memory, a checkpoint, or a fresh start
    FIRST_STEP = "first_step"  # the first optimizer step of the attempt is done


#: The phases before the decision that only a grow onto a newly joined node has.
JOIN_PHASES = (Phase.NODE_JOINED, Phase.PROCESS_WARM)


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
        """Each phase with its seconds since the previous one and since the first mark (the
        decision; a grow onto a node that joined: the join)."""
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
    slow_nodes: tuple[str, ...] = ()
    """Nodes of the attempt's stragglers now (`elastrain.workers.runtime.stragglers`)."""

    @property
    def metrics(self) -> list[StepMetrics]:
        return [m for m in self.messages if isinstance(m, StepMetrics)]
