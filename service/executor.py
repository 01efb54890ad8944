"""Carry out what `elastrain.service.decisions.decide` returned: the DB, then Ray, then files.

For one job, every DB write of a decision lands in one short transaction, under the job's
row lock, and only if the job is still where the decision saw it (same state, same
attempt): a user's cancel or another scheduler that moved it first wins, and the next pass
decides again. Ray calls (launch, control, release) and file deletions run after the commit
and outside any lock, in the order decided, so a rolled-back decision never launched
anything, and a slow Ray call or storage scan never holds a row.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from elastrain.checkpoints.fence import advance_fence, claim_job_folder
from elastrain.checkpoints.retention import delete_checkpoints, retention_plan
from elastrain.contracts.datasets import (
    DATA_WORKLOADS,
    DataPathError,
    paths_as_given,
    storage_relative_data_paths,
)
from elastrain.contracts.messages import (
    Control,
    DriverReport,
    EventKind,
    WorkerError,
    WorkerFailed,
)
from elastrain.contracts.os_identity import RunAs
from elastrain.contracts.prepared import InputError, storage_relative_prepare_paths
from elastrain.contracts.runtime import AttemptKey, LaunchRequest, attempt_name
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.storage import JobStorage
from elastrain.service import identity, jobs, metric_store, observe, reports, telemetry
from elastrain.service.capacity import NODE_JOINED_AT, PROCESS_WARM_AT
from elastrain.service.db import session_scope
from elastrain.service.decisions import (
    Action,
    ApplyRetention,
    AttemptOutcome,
    DelayRelaunch,
    EndAttempt,
    Facts,
    JobView,
    MarkSpare,
    PersistReport,
    RecordEvent,
    SendControl,
    SetReason,
    StartAttempt,
    StartWaiting,
    StopWaiting,
    Transition,
    decide,
    give_up,
)
from elastrain.service.launcher import Launcher
from elastrain.service.metric_limits import MetricBudgets
from elastrain.service.models import Job, utcnow
from elastrain.service.states import JobState

log = logging.getLogger("elastrain.executor")


@dataclass
class Timers:
    """Soft state: lost on restart, harmlessly (a relaunch is just not delayed, growth
    waits one more interval)."""

    relaunch_not_before: dict[int, float] = field(default_factory=dict)
    spare_since: dict[int, float] = field(default_factory=dict)
    kept_off: dict[int, dict[str, float]] = field(default_factory=dict)
    """Job -> node -> until when the job keeps off it (`failure.stragglers: evict`): a
    restart forgets it, and the job may then grow back onto the node sooner."""


# -- effects: what happens once the DB has committed ---------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    request: LaunchRequest


@dataclass(frozen=True, slots=True)
class Release:
    key: AttemptKey
    final: bool = False
    """The job has ended: its processes need not keep its state."""


@dataclass(frozen=True, slots=True)
class Signal:
    key: AttemptKey
    control: Control


@dataclass(frozen=True, slots=True)
class PruneCheckpoints:
    """Retention (`ApplyRetention`): its scan of storage waits for the commit too."""

    job_id: int
    root: Path
    keep_last: int


@dataclass(frozen=True, slots=True)
class SetTimer:
    job_id: int
    timer: DelayRelaunch | MarkSpare


Effect = Launch | Release | Signal | PruneCheckpoints | SetTimer


def apply_to_db(
    session: Session,
    job: Job,
    actions: Sequence[Action],
    *,
    storage_path: Path,
    budgets: MetricBudgets | None = None,
) -> list[Effect]:
    """Write `actions` to the job's rows (through `elastrain.service.jobs`, one function per kind)
    and return the effects to carry out once the transaction has committed. Reported
    metrics are stored within `budgets` (`elastrain.service.metric_limits`)."""
    effects: list[Effect] = []
    for action in actions:
        key = AttemptKey(job.id, job.attempt)
        if isinstance(action, Transition):
            jobs.set_job_state(
                session,
                job,
                action.to,
                reason=action.reason,
                world_size=action.world_size,
                details=dict(action.details) if action.details else None,
            )
        elif isinstance(action, SetReason):
            jobs.set_state_reason(job, reason=action.reason)
        elif isinstance(action, RecordEvent):
            jobs.record_event(
                session, job, kind=action.kind, reason=action.reason, details=action.details
            )
        elif isinstance(action, PersistReport):
            report = _failures_as_given(action.report, storage_path, job.owner)
            reports.persist_report(session, job, report, budgets=budgets)
        elif isinstance(action, ApplyRetention):
            root = JobStorage.of(storage_path, job.id).checkpoints
            effects.append(PruneCheckpoints(job_id=job.id, root=root, keep_last=action.keep_last))
        elif isinstance(action, StartAttempt):
            name = attempt_name(job.id, job.attempt + 1)
            cause, detected_at, joined = _start_cause(session, job)
            attempt = jobs.start_attempt(
                session, job, world_size=action.world_size, driver_name=name
            )
            spec = launch_spec(JobSpec.from_stored(job.spec), storage_path, job.owner)
            if action.strategy is not None:  # `auto`: the workers run what the plan chose
                tp = action.tensor_parallel if action.tensor_parallel > 1 else None
                chosen = spec.strategy.model_copy(
                    update={"kind": action.strategy, "tensor_parallel": tp}
                )
                job.strategy = chosen.label
                spec = spec.model_copy(update={"strategy": chosen})
            effects.append(
                Launch(
                    LaunchRequest(
                        job_id=job.id,
                        attempt=attempt.number,
                        world_size=action.world_size,
                        spec=spec,
                        storage_path=str(storage_path),
                        name=name,
                        database=identity.database_id(session),
                        cause=cause,
                        detected_at=detected_at,
                        joined_at=joined.get(NODE_JOINED_AT, 0.0),
                        warm_at=joined.get(PROCESS_WARM_AT, 0.0),
                        avoid_nodes=action.avoid_nodes,
                        tenant=job.owner,
                    )
                )
            )
        elif isinstance(action, EndAttempt):
            error = action.error
            if error is not None:
                error = _error_as_given(error, storage_path, job.owner)
            jobs.end_attempt(
                session,
                job,
                outcome=action.outcome.value,
                error=error,
                step=action.step,
                count_restart=action.count_restart,
            )
            effects.append(Release(key))
        elif isinstance(action, SendControl):
            if action.control in (Control.STOP, Control.LEAVE):
                jobs.request_stop(session, job)
            elif action.control == Control.CHECKPOINT:
                jobs.checkpoint_request_sent(session, job, reason=action.why)
            effects.append(Signal(key, action.control))
        elif isinstance(action, StartWaiting):
            jobs.start_waiting(
                session,
                job,
                reason=action.reason,
                since=datetime.fromtimestamp(action.at, timezone.utc),
            )
        elif isinstance(action, StopWaiting):
            jobs.stop_waiting(session, job, reason=action.reason)
        elif isinstance(action, DelayRelaunch | MarkSpare):
            effects.append(SetTimer(job.id, action))
    if JobState(job.state).is_terminal:
        effects = [Release(e.key, final=True) if isinstance(e, Release) else e for e in effects]
    return effects


def _error_as_given(error: WorkerError, storage_path: Path, owner: str) -> WorkerError:
    """A failure with its paths as the tenant gave them (`mymodel/`, not the server's)."""
    return dataclasses.replace(
        error,
        message=paths_as_given(error.message, storage_path, owner),
        traceback=paths_as_given(error.traceback, storage_path, owner),
    )


def _failures_as_given(report: DriverReport, storage_path: Path, owner: str) -> DriverReport:
    """`report` with every rank's failure (an event the tenant reads) as `_error_as_given`."""
    if not any(isinstance(m, WorkerFailed) for m in report.messages):
        return report
    messages = tuple(
        WorkerFailed(error=_error_as_given(m.error, storage_path, owner))
        if isinstance(m, WorkerFailed)
        else m
        for m in report.messages
    )
    return dataclasses.replace(report, messages=messages)


class SpecRefused(Exception):
    """The job's spec cannot be launched as it stands (a data path outside its owner's
    area): the job fails with this as its reason, whatever it was when submitted."""


def launch_spec(spec: JobSpec, storage_path: Path, owner: str) -> JobSpec:
    """The spec the workers get: a built-in gpt's (or hf_causal_lm's) data paths resolved in the owner's data
    area and handed over relative to the storage root, checked again at every launch (the
    files may have become links since the submit)."""
    if spec.workload.name == "prepare":
        try:
            params = storage_relative_prepare_paths(spec.workload.params, storage_path, owner)
        except (DataPathError, InputError) as exc:
            raise SpecRefused(str(exc)) from exc
    elif spec.workload.name not in DATA_WORKLOADS:
        return spec
    else:
        try:
            params = storage_relative_data_paths(spec.workload.params, storage_path, owner)
        except DataPathError as exc:
            raise SpecRefused(str(exc)) from exc
    if params == spec.workload.params:
        return spec
    workload = spec.workload.model_copy(update={"params": params})
    return spec.model_copy(update={"workload": workload})


#: What the previous attempt's outcome says about why the next one starts.
_CAUSES = {
    AttemptOutcome.NODE_LOST.value: "node lost",
    AttemptOutcome.STOPPED.value: "resize",
    AttemptOutcome.FAILED.value: "failed",
}


def _start_cause(session: Session, job: Job) -> tuple[str, float, dict[str, float]]:
    """Why the job's next attempt starts, and since when (its timeline's first mark): the
    submission, the end of the previous attempt (node lost, failed), or the grow decision;
    for a grow onto nodes that joined, when they joined and were warm (`grow_joins`)."""
    previous = jobs.current_attempt(session, job)
    if previous is None or previous.ended_at is None:
        return "submitted", _timestamp(job.created_at), {}
    cause = _CAUSES.get(previous.outcome or "", "restart")
    if cause != "resize":
        return cause, _timestamp(previous.ended_at), {}
    # A resize starts when it was decided: the old attempt's checkpoint-and-stop is part
    # of what it costs; a grow's, when its node joined: the wait for the node's process too.
    decided = jobs.last_entry(session, job, JobState.RESIZING)
    if decided is None:
        return cause, _timestamp(previous.ended_at), {}
    details = decided.details or {}
    joined = {
        k: float(details[k])
        for k in (NODE_JOINED_AT, PROCESS_WARM_AT)
        if isinstance(details.get(k), int | float)
    }
    return cause, _timestamp(decided.at), joined


def _timestamp(moment: datetime) -> float:
    # SQLite hands back naive datetimes; every stored time is UTC.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    return aware.timestamp()


def _moved(job: Job, view: JobView) -> bool:
    """The job is no longer where its decision saw it (another state or attempt): a
    user's cancel or another scheduler got there first, and the next pass decides again."""
    return (job.state, job.attempt) != (view.state, view.attempt.number if view.attempt else 0)


class Executor:
    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        launcher: Launcher,
        storage_path: Path,
        timers: Timers,
        metric_budgets: MetricBudgets | None = None,
        tenant_users: Mapping[str, RunAs] | None = None,
    ) -> None:
        self.sessions = sessions
        self.launcher = launcher
        self.storage_path = storage_path
        self.timers = timers
        #: Running jobs' open bucket summaries, as this executor stored them; the scheduler
        #: clears them whenever its hold on the lease may have lapsed.
        self.buckets = metric_store.OpenBuckets()
        #: What each running job may still store of its metrics (None: no limits).
        self.metric_budgets = metric_budgets
        self._database: str | None = None
        #: The OS identity each tenant's command scripts run as (`ELASTRAIN_TENANT_USERS`).
        self.tenant_users = dict(tenant_users or {})

    @property
    def database(self) -> str:
        """This database's identity (`elastrain.service.identity`), which owns its jobs' folders."""
        if self._database is None:
            with session_scope(self.sessions) as session:
                self._database = identity.database_id(session)
        return self._database

    def execute(self, view: JobView, actions: Sequence[Action]) -> bool:
        """Apply what was decided on `view`. False when nothing was done: the job moved
        since `view` was read, or the transaction failed (the next pass decides again)."""
        if not actions:
            return True
        # Whatever this writes of the job's bucket summaries, the cache does not see it.
        self.buckets.forget(view.id)
        try:
            with session_scope(self.sessions) as session:
                job = jobs.get_job(session, view.id, for_update=True)
                if _moved(job, view):
                    log.info("job %s moved since it was observed; deciding again", view.id)
                    return False
                samples = telemetry.samples_for(job, actions, now=utcnow())
                effects = self._apply(session, job, actions)
        except SpecRefused as exc:
            self.give_up_on(view.id, f"cannot launch: {exc}")
            return False
        except Exception:
            log.exception("job %s: applying %s failed; retrying next pass", view.id, actions)
            return False
        telemetry.record(samples)  # counted once committed, like the effects
        for effect in effects:
            self._carry_out(effect)
        return True

    def _apply(self, session: Session, job: Job, actions: Sequence[Action]) -> list[Effect]:
        return apply_to_db(
            session, job, actions, storage_path=self.storage_path, budgets=self.metric_budgets
        )

    def give_up_on(self, job_id: int, reason: str) -> bool:
        """Fail a job the scheduler cannot decide about (`decisions.give_up`): read from
        its row alone, so a spec that does not read back is no obstacle. False when the
        transaction failed (the next pass tries again)."""
        try:
            with session_scope(self.sessions) as session:
                job = jobs.get_job(session, job_id, for_update=True)
                attempt = jobs.current_attempt(session, job)
                live = attempt is not None and attempt.ended_at is None
                actions = give_up(JobState(job.state), live_attempt=live, reason=reason)
                effects = self._apply(session, job, actions)
        except Exception:
            log.exception("job %s: failing it (%s) failed; retrying next pass", job_id, reason)
            return False
        for effect in effects:
            self._carry_out(effect)
        return True

    def execute_steady(self, batch: Sequence[tuple[JobView, PersistReport]]) -> None:
        """Store the steady reports (`reports.is_steady`) of many running jobs in one
        transaction, under their row locks, each only if its job is still where its
        decision saw it; one slow commit per pass instead of one per job. Steady reports
        have no effects to carry out. A report that recomputes stored steps is stored
        alone afterwards (`execute`), and so is each one if the batch fails as a whole:
        one bad report cannot hold back the others' progress."""
        if not batch:
            return
        samples: list[telemetry.Sample] = []
        alone: list[tuple[JobView, PersistReport]] = []
        try:
            with session_scope(self.sessions) as session:
                locked = reports.lock_running(session, [view.id for view, _ in batch])
                todo = []
                for view, action in batch:
                    running = locked.get(view.id)
                    if running is None or _moved(running.job, view):
                        log.info("job %s moved since it was observed; deciding again", view.id)
                    elif not reports.appends_only(running.job, action.report):
                        alone.append((view, action))
                    else:
                        todo.append((running, action.report))
                        samples += telemetry.report_samples(action.report, tenant=view.owner)
                stored = reports.persist_steady_reports(
                    session, todo, buckets=self.buckets, budgets=self.metric_budgets
                )
        except Exception:
            log.exception("storing %d jobs' reports together failed; one by one", len(batch))
            for view, action in batch:
                self.execute(view, [action])
            return
        stored.remember(self.buckets)  # committed: what the next pass need not read
        telemetry.record(samples)
        for view, action in alone:
            self.execute(view, [action])

    def _carry_out(self, effect: Effect) -> None:
        try:
            if isinstance(effect, Launch):
                self._launch(effect.request)
            elif isinstance(effect, Release):
                # Ended for the control plane, so ended for storage too: from now on its
                # workers, if any still live somewhere, may write nothing (a zombie).
                self._fence(effect.key.job_id, effect.key.attempt + 1)
                self.launcher.release(effect.key, final=effect.final)
            elif isinstance(effect, Signal):
                self.launcher.send_control(effect.key, effect.control)
            elif isinstance(effect, PruneCheckpoints):
                self._prune(effect)
            elif isinstance(effect, SetTimer):
                self._set_timer(effect)
        except Exception:  # the DB is right; a level-triggered next pass repairs the rest
            log.exception("carrying out %s failed", effect)

    def _launch(self, request: LaunchRequest) -> None:
        # The fence first: from here on the job's older attempts may write nothing to
        # storage (checkpoints/fence.py); usually it moved already, when the previous
        # attempt ended.
        self._claim_folder(request)
        self._fence(request.job_id, request.attempt)
        run_as = self.tenant_users.get(request.tenant)
        if run_as is not None and request.spec.workload.command:
            request = dataclasses.replace(request, run_as=str(run_as))
        try:
            self.launcher.launch(request)
        except Exception as exc:  # the next pass sees the driver as LOST and retries
            log.error("launch of %s failed: %s", request.name, exc)
            self._event(
                request.job_id,
                EventKind.LAUNCH_FAILED,
                f"{type(exc).__name__}: {exc}",
                details={"traceback": traceback.format_exc()[-2000:]},
            )

    def _event(
        self, job_id: int, kind: EventKind, reason: str, details: dict[str, Any] | None = None
    ) -> None:
        """An event of the job, in a transaction of its own (after an effect)."""
        with session_scope(self.sessions) as session:
            job = jobs.get_job(session, job_id, for_update=True)
            jobs.record_event(session, job, kind=kind, reason=reason, details=details)

    def _claim_folder(self, request: LaunchRequest) -> None:
        """The job's folder is the job's and this database's before its workers read a
        checkpoint there: at its first attempt, whatever was already at its path (planted
        by another job's code, left by another database) is moved aside and recorded."""
        root = JobStorage.of(self.storage_path, request.job_id).root
        try:
            moved = claim_job_folder(root, self.database, first_attempt=request.attempt == 1)
        except OSError as exc:
            log.error("job %s: cannot move what is at its folder aside: %s",
                      request.job_id, exc)  # fmt: skip
            return
        if moved is None:
            return
        log.warning("job %s: %s was there before the job (not made for it); moved to %s",
                    request.job_id, root, moved)  # fmt: skip
        self._event(
            request.job_id,
            EventKind.FOLDER_SET_ASIDE,
            f"a folder at this job's path predates it: moved aside as {moved.name}",
        )

    def _fence(self, job_id: int, attempt: int) -> None:
        """Only `attempt` (or a newer one) of the job may write to storage from now on.
        Carry on if storage refuses: the database fences every report anyway, and a zombie
        is rarer than a full disk."""
        try:
            root = JobStorage.of(self.storage_path, job_id).root
            advance_fence(root, attempt, time.time(), owner=self.database)
        except OSError as exc:
            log.error("job %s: cannot write its attempt fence: %s", job_id, exc)

    def _prune(self, effect: PruneCheckpoints) -> None:
        """Retention: which checkpoints go is read from storage with no lock held (a slow
        shared filesystem holds up no writer of the job's row); their catalogue rows go
        in a short transaction of their own, then their folders. Rows first: a crash in
        between leaves folders the catalogue no longer lists, which the next retention
        deletes. A fresh scan keeps the last K and the newest committed checkpoint
        whatever was committed since the decision (`elastrain.checkpoints.retention`)."""
        doomed = retention_plan(effect.root, effect.keep_last)
        if not doomed:
            return
        with session_scope(self.sessions) as session:
            job = jobs.get_job(session, effect.job_id, for_update=True)
            reports.delete_checkpoint_rows(session, job, paths=[str(p) for p in doomed])
        delete_checkpoints(effect.root, doomed)

    def _set_timer(self, effect: SetTimer) -> None:
        timer = effect.timer
        if isinstance(timer, DelayRelaunch):
            self.timers.relaunch_not_before[effect.job_id] = timer.until
        elif timer.since is None:
            self.timers.spare_since.pop(effect.job_id, None)
        else:
            self.timers.spare_since[effect.job_id] = timer.since


#: Actions that need the job's driver: only the scheduler carries those out.
_NEEDS_DRIVER = (StartAttempt, EndAttempt, SendControl)


def cancel(
    session: Session,
    job: Job,
    *,
    storage_path: Path,
    clock: Callable[[], float] = time.time,
) -> None:
    """A user's cancel, in the caller's transaction. A job no driver holds (queued, or
    waiting between attempts) is cancelled at once, by the same decision the scheduler
    would take; otherwise the request is recorded and the scheduler stops the driver."""
    if not jobs.request_cancel(session, job):
        return
    actions = decide(observe.view_of(session, job), Facts(now=clock()))
    if any(isinstance(a, _NEEDS_DRIVER) for a in actions):
        jobs.record_event(
            session, job, kind=EventKind.CANCEL_REQUESTED, reason="cancel requested by user"
        )
        return
    effects = apply_to_db(session, job, actions, storage_path=storage_path)
    assert not effects, f"a cancel without a driver has nothing to carry out: {effects}"
