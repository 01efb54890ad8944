"""The scheduler: a level-triggered reconcile loop, the only writer of run state.

Each pass compares what the DB says (jobs, attempts) with what the launcher says (the
cluster, each driver's report) and fixes the difference: persist reports, move states,
relaunch after failures, grow jobs back, admit queued jobs. Nothing is kept in memory
that a restarted control plane could not rebuild from the DB and the drivers' names,
except timers (backoff, growth hysteresis), which simply start over.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from checkpoints.retention import apply_retention
from service import decisions, jobs, lease
from service.cluster import ClusterView, NodeView, publish
from service.db import session_scope
from service.decisions import (
    Allocation,
    FailureAction,
    FailureCause,
    PendingJob,
    WorkerShape,
)
from service.launcher.base import (
    ClusterCapacity,
    DriverReport,
    DriverStatus,
    Launcher,
    LaunchRequest,
    driver_name,
)
from service.models import Attempt, CheckpointRecord, Event, Job, as_utc, utcnow
from service.settings import Settings
from service.spec import JobSpec
from service.states import ACTIVE, JobState

log = logging.getLogger("elastrain.scheduler")

LEASE_TTL_S = 10.0


def job_dir(storage_path: Path | str, job_id: int) -> Path:
    return Path(storage_path) / "jobs" / str(job_id)


def checkpoint_root(storage_path: Path | str, job_id: int) -> Path:
    return job_dir(storage_path, job_id) / "checkpoints"


@dataclass
class _Timers:
    """Soft state: lost on restart, harmlessly (a relaunch is just not delayed)."""

    not_before: dict[int, float] = field(default_factory=dict)  # job -> earliest relaunch
    spare_since: dict[int, float] = field(default_factory=dict)  # job -> bigger size possible since


class Scheduler:
    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        launcher: Launcher,
        settings: Settings,
        holder: str | None = None,
        clock=time.time,  # type: ignore[no-untyped-def]
    ) -> None:
        self.sessions = session_factory
        self.launcher = launcher
        self.settings = settings
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.clock = clock
        self.timers = _Timers()
        self._pending_launches: list[LaunchRequest] = []

    # -- one pass -------------------------------------------------------------------------
    def run_pass(self) -> bool:
        """One reconcile pass. Returns False when another scheduler holds the lease."""
        if not lease.try_acquire(self.sessions, holder=self.holder, ttl_s=LEASE_TTL_S):
            return False
        cluster = self.launcher.capacity()
        with session_scope(self.sessions) as s:
            active_ids = list(s.scalars(select(Job.id).where(Job.state.in_(list(ACTIVE)))))
        for job_id in active_ids:
            self._guarded(job_id, lambda jid=job_id: self._reconcile(jid, cluster))
        self._admit(cluster)
        self._consider_growth(cluster)
        self._publish(cluster)
        return True

    def _guarded(self, job_id: int, fn) -> None:  # type: ignore[no-untyped-def]
        """One job's trouble (a DB conflict, a Ray hiccup) must not stop the others.

        Launches queued by `fn` are carried out only once its transaction has committed:
        a rolled-back attempt (say, another scheduler won the row) must never run."""
        try:
            fn()
        except Exception:
            self._pending_launches.clear()
            log.exception("scheduler: job %s: reconcile failed; retrying next pass", job_id)
            return
        self._flush_launches()

    # -- per job ----------------------------------------------------------------------------
    def _reconcile(self, job_id: int, cluster: ClusterCapacity) -> None:
        with session_scope(self.sessions) as s:
            job = jobs.get_job(s, job_id, for_update=True)
            if not job.state.is_active:
                return
            spec = jobs.job_spec(job)
            attempt = jobs.current_attempt(s, job)
            if attempt is None or attempt.ended_at is not None:
                if job.cancel_requested:
                    jobs.set_job_state(s, job, JobState.CANCELLED, reason="cancelled by user")
                    return
                self._relaunch_if_possible(s, job, spec, cluster)
                return
            if job.cancel_requested:
                self.launcher.kill(job.id, attempt.number)
                jobs.end_attempt(s, job, number=attempt.number, outcome="cancelled")
                jobs.set_job_state(s, job, JobState.CANCELLED, reason="cancelled by user")
                self.launcher.release(job.id, attempt.number)
                return
            report = self.launcher.poll(job.id, attempt.number)
            self._persist_report(s, job, spec, attempt, report)
            if job.checkpoint_requested:
                self.launcher.request_checkpoint(job.id, attempt.number)
                job.checkpoint_requested = False
                jobs.record_event(
                    s, job, kind="checkpoint_requested", reason="checkpoint now (user)"
                )
            if self._handle_node_loss(s, job, spec, attempt, cluster, report):
                return
            self._handle_status(s, job, spec, attempt, report, cluster)

    def _persist_report(
        self, s: Session, job: Job, spec: JobSpec, attempt: Attempt, report: DriverReport
    ) -> None:
        if report.placement and not attempt.nodes:
            attempt.nodes = decisions.placement_nodes(report.placement)  # type: ignore[assignment]
            jobs.record_event(
                s,
                job,
                kind="placement",
                reason=f"{len(report.placement)} workers on {len(set(report.placement.values()))} node(s)",
                details={
                    "ranks": {str(r): n for r, n in report.placement.items()},
                    "pids": {str(r): p for r, p in report.pids.items()},
                },
            )
        for ev in report.events:
            jobs.record_event(
                s,
                job,
                kind=ev.get("kind", "worker"),
                reason=ev.get("reason", ""),
                details=ev.get("details"),
            )
        jobs.record_metrics(s, job, attempt=attempt.number, points=report.metrics)
        if report.metrics:
            last = report.metrics[-1]
            if last.get("world_size") and job.world_size != last["world_size"]:
                job.world_size = int(last["world_size"])
        for commit in report.commits:
            jobs.record_checkpoint(
                s,
                job,
                attempt=attempt.number,
                step=int(commit["step"]),
                world_size=int(commit.get("world_size") or attempt.world_size),
                path=str(commit["path"]),
                size_bytes=int(commit.get("bytes") or 0),
                manifest=commit.get("manifest"),
            )
        if report.commits:
            self._apply_retention(s, job, spec)

    def _apply_retention(self, s: Session, job: Job, spec: JobSpec) -> None:
        # Files first, then the rows: a crash in between leaves rows pointing at missing
        # folders, which the next retention pass (and the loader) tolerate.
        deleted = apply_retention(
            checkpoint_root(self.settings.storage_path, job.id), spec.checkpoint.keep_last
        )
        if deleted:
            deleted_paths = {str(p) for p in deleted}
            for row in s.scalars(select(CheckpointRecord).where(CheckpointRecord.job_id == job.id)):
                if row.path in deleted_paths:
                    s.delete(row)

    def _handle_node_loss(
        self,
        s: Session,
        job: Job,
        spec: JobSpec,
        attempt: Attempt,
        cluster: ClusterCapacity,
        report: DriverReport,
    ) -> bool:
        placement = dict(enumerate(attempt.nodes or []))
        lost = decisions.lost_ranks(placement, cluster.alive_ids())
        if not lost or report.status == DriverStatus.SUCCEEDED:
            return False
        for node, ranks in lost.items():
            jobs.record_event(
                s,
                job,
                kind="node_lost",
                reason=f"node {node[:12]} lost (ranks {ranks})",
                details={"node_id": node, "ranks": ranks},
            )
        # Don't wait for Ray Train to notice the dead peers: stop the survivors now and
        # relaunch from the latest checkpoint at the size the cluster still holds.
        self.launcher.kill(job.id, attempt.number)
        jobs.end_attempt(s, job, number=attempt.number, outcome="node_lost", error=report.error)
        self.launcher.release(job.id, attempt.number)
        nodes = ", ".join(n[:12] for n in lost)
        self._enter_recovery(s, job, spec, cluster, reason=f"node lost ({nodes})")
        return True

    def _handle_status(
        self,
        s: Session,
        job: Job,
        spec: JobSpec,
        attempt: Attempt,
        report: DriverReport,
        cluster: ClusterCapacity,
    ) -> None:
        status = report.status
        if status == DriverStatus.RUNNING and self._should_mark_running(s, job, attempt):
            if report.resumed_from_step is not None:
                reason = f"resumed from step {report.resumed_from_step} at world size {attempt.world_size}"
            else:
                reason = f"training started at world size {attempt.world_size}"
            jobs.set_job_state(
                s, job, JobState.RUNNING, reason=reason, world_size=attempt.world_size
            )
        elif status == DriverStatus.SUCCEEDED:
            jobs.end_attempt(s, job, number=attempt.number, outcome="succeeded")
            jobs.set_job_state(s, job, JobState.SUCCEEDED, reason=f"reached step {job.step}")
            self.launcher.release(job.id, attempt.number)
        elif status == DriverStatus.STOPPED:
            jobs.end_attempt(s, job, number=attempt.number, outcome="stopped")
            self.launcher.release(job.id, attempt.number)
            if job.state != JobState.RESIZING:
                jobs.set_job_state(s, job, JobState.RESIZING, reason="stopped after checkpoint")
            self._relaunch_if_possible(s, job, spec, cluster)
        elif status in (DriverStatus.FAILED, DriverStatus.LOST):
            self._on_failure(s, job, spec, attempt, report, cluster)

    def _should_mark_running(self, s: Session, job: Job, attempt: Attempt) -> bool:
        if job.state == JobState.RUNNING:
            return False
        if job.state != JobState.RESIZING:
            return True
        # RESIZING with the attempt we asked to stop: it trains on until its checkpoint;
        # only the relaunched (newer) attempt makes the job RUNNING again.
        resizing_attempt = s.scalar(
            select(Event.attempt)
            .where(Event.job_id == job.id, Event.to_state == JobState.RESIZING.value)
            .order_by(Event.id.desc())
            .limit(1)
        )
        return resizing_attempt is None or attempt.number > resizing_attempt

    def _on_failure(
        self,
        s: Session,
        job: Job,
        spec: JobSpec,
        attempt: Attempt,
        report: DriverReport,
        cluster: ClusterCapacity,
    ) -> None:
        cause = (
            FailureCause.WORKER_ERROR
            if report.status == DriverStatus.FAILED
            else FailureCause.DRIVER_LOST
        )
        error = report.error or (
            "driver lost" if cause == FailureCause.DRIVER_LOST else "worker group failed"
        )
        recent = self._failure_history(s, job)
        jobs.end_attempt(
            s, job, number=attempt.number, outcome="failed", error=_error_key(error, job.step)
        )
        self.launcher.kill(job.id, attempt.number)
        self.launcher.release(job.id, attempt.number)
        job.last_error = error
        decision = decisions.decide_failure(
            cause=cause,
            error=error,
            step=job.step,
            restarts=job.restarts,
            max_restarts=spec.failure.max_restarts,
            recent_failures=recent,
            backoff_s=self.settings.restart_backoff_s,
        )
        if decision.action == FailureAction.GIVE_UP:
            jobs.set_job_state(s, job, JobState.FAILED, reason=decision.reason)
            return
        if decision.counts_as_restart:
            job.restarts += 1
        self.timers.not_before[job.id] = self.clock() + decision.delay_s
        self._enter_recovery(
            s,
            job,
            spec,
            cluster,
            reason=f"restart {job.restarts}/{spec.failure.max_restarts} after: {error}",
        )

    def _failure_history(self, s: Session, job: Job) -> list[tuple[str | None, int]]:
        rows = s.scalars(
            select(Attempt.error)
            .where(Attempt.job_id == job.id, Attempt.outcome == "failed")
            .order_by(Attempt.number)
        ).all()
        history: list[tuple[str | None, int]] = []
        for key in rows:
            err, _, step = (key or "").rpartition("@step=")
            history.append((err or None, int(step) if step.isdigit() else -1))
        return history

    def _enter_recovery(
        self, s: Session, job: Job, spec: JobSpec, cluster: ClusterCapacity, *, reason: str
    ) -> None:
        free = decisions.free_capacity(cluster, self._allocations(s, exclude=job.id))
        target = decisions.target_world_size(spec, free, held=0)
        if job.state != JobState.RECOVERING:
            jobs.set_job_state(
                s, job, JobState.RECOVERING, reason=reason, world_size=target or None
            )
        self._relaunch_if_possible(s, job, spec, cluster)

    def _relaunch_if_possible(
        self, s: Session, job: Job, spec: JobSpec, cluster: ClusterCapacity
    ) -> None:
        now = self.clock()
        if now < self.timers.not_before.get(job.id, 0.0):
            return
        free = decisions.free_capacity(cluster, self._allocations(s, exclude=job.id))
        size = decisions.target_world_size(spec, free, held=0)
        if size == 0:
            self._wait_below_min(s, job, spec, free)
            return
        if job.below_min_since is not None:
            waited = (utcnow() - as_utc(job.below_min_since)).total_seconds()
            jobs.record_event(
                s,
                job,
                kind="capacity",
                reason=f"capacity for {size} workers after waiting {waited:.0f}s",
            )
            job.below_min_since = None
        self._start_attempt(s, job, spec, size)

    def _wait_below_min(self, s: Session, job: Job, spec: JobSpec, free: ClusterCapacity) -> None:
        shape = WorkerShape.of(spec)
        fit = free.workers_that_fit(shape.cpus, shape.gpus)
        reason = f"waiting below min: {fit} workers fit, the job needs {spec.min_world_size}"
        if job.below_min_since is None:
            job.below_min_since = utcnow()
            job.state_reason = reason
            jobs.record_event(s, job, kind="below_min", reason=reason)
            return
        waited = (utcnow() - as_utc(job.below_min_since)).total_seconds()
        if waited > self.settings.below_min_timeout_s:
            jobs.set_job_state(
                s,
                job,
                JobState.FAILED,
                reason=f"below min_workers for {waited:.0f}s (timeout "
                f"{self.settings.below_min_timeout_s:g}s): {reason}",
            )

    def _start_attempt(self, s: Session, job: Job, spec: JobSpec, size: int) -> None:
        name = driver_name(job.id, job.attempt + 1)
        attempt = jobs.start_attempt(s, job, world_size=size, driver_name=name)
        job.state_reason = f"launching attempt {attempt.number} at world size {size}"
        self.timers.spare_since.pop(job.id, None)
        # Launch only after the attempt is committed: a crash in between leaves an
        # attempt without a driver, which the next pass sees as LOST and relaunches.
        self._pending_launches.append(
            LaunchRequest(
                job_id=job.id,
                attempt=attempt.number,
                world_size=size,
                spec=job.spec,
                storage_path=str(self.settings.storage_path),
                driver_name=name,
            )
        )

    def _flush_launches(self) -> None:
        launches, self._pending_launches = self._pending_launches, []
        for req in launches:
            try:
                self.launcher.launch(req)
            except Exception as exc:  # the next pass sees the driver as LOST and retries
                log.error("launch of %s failed: %s", req.driver_name, exc)
                with session_scope(self.sessions) as s:
                    job = jobs.get_job(s, req.job_id, for_update=True)
                    jobs.record_event(
                        s,
                        job,
                        kind="launch_failed",
                        reason=f"{type(exc).__name__}: {exc}",
                        details={"traceback": traceback.format_exc()[-2000:]},
                    )

    # -- cluster-wide -------------------------------------------------------------------------
    def _allocations(self, s: Session, *, exclude: int | None = None) -> list[Allocation]:
        rows = s.execute(
            select(Job, Attempt)
            .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt))
            .where(Job.state.in_(list(ACTIVE)), Attempt.ended_at.is_(None))
        ).all()
        allocs = []
        for job, attempt in rows:
            if job.id == exclude:
                continue
            spec = jobs.job_spec(job)
            allocs.append(
                Allocation(
                    shape=WorkerShape.of(spec),
                    count=attempt.world_size,
                    nodes=tuple(attempt.nodes or ()),
                )
            )
        return allocs

    def _admit(self, cluster: ClusterCapacity) -> None:
        with session_scope(self.sessions) as s:
            pending_rows = s.scalars(
                select(Job).where(Job.state == JobState.PENDING).order_by(Job.created_at, Job.id)
            ).all()
            if not pending_rows:
                return
            pending = [
                PendingJob(job_id=j.id, priority=j.priority, spec=jobs.job_spec(j))
                for j in pending_rows
            ]
            free = decisions.free_capacity(cluster, self._allocations(s))
            admissions, waiting = decisions.plan_admissions(pending, free, cluster)
            for wait in waiting:
                job = next(j for j in pending_rows if j.id == wait.job_id)
                job.state_reason = wait.reason
        for admission in admissions:
            self._guarded(
                admission.job_id, lambda a=admission: self._admit_one(a.job_id, a.world_size)
            )

    def _admit_one(self, job_id: int, size: int) -> None:
        with session_scope(self.sessions) as s:
            # Re-read under a row lock: another scheduler (or a cancel) may have moved it.
            job = jobs.get_job(s, job_id, for_update=True)
            if job.state != JobState.PENDING:
                return
            if job.cancel_requested:
                jobs.set_job_state(s, job, JobState.CANCELLED, reason="cancelled by user")
                return
            spec = jobs.job_spec(job)
            jobs.set_job_state(
                s, job, JobState.STARTING, reason=f"admitted at world size {size}", world_size=size
            )
            self._start_attempt(s, job, spec, size)

    def _consider_growth(self, cluster: ClusterCapacity) -> None:
        now = self.clock()
        with session_scope(self.sessions) as s:
            others_waiting = (
                s.scalars(select(Job.id).where(Job.state == JobState.PENDING).limit(1)).first()
                is not None
            )
            allocs = self._allocations(s)
            free = decisions.free_capacity(cluster, allocs)
            running = s.scalars(select(Job).where(Job.state == JobState.RUNNING)).all()
            for job in running:
                spec = jobs.job_spec(job)
                current = job.world_size or 0
                possible = decisions.target_world_size(spec, free, held=current)
                if possible <= current:
                    self.timers.spare_since.pop(job.id, None)
                    continue
                since = self.timers.spare_since.setdefault(job.id, now)
                if not decisions.should_grow(
                    current=current,
                    possible=possible,
                    spare_since=since,
                    now=now,
                    grow_interval_s=self.settings.grow_interval_s,
                    others_waiting=others_waiting,
                ):
                    continue
                locked = jobs.get_job(s, job.id, for_update=True)
                if locked.state != JobState.RUNNING:
                    continue
                self.launcher.request_stop(job.id, job.attempt)
                jobs.set_job_state(
                    s,
                    locked,
                    JobState.RESIZING,
                    reason=f"capacity for {possible} workers: growing {current} -> {possible}",
                    world_size=possible,
                )
                self.timers.spare_since.pop(job.id, None)
                # Capacity promised to this job is not offered to the next one this pass.
                free = decisions.take_workers(free, WorkerShape.of(spec), possible - current)

    def _publish(self, cluster: ClusterCapacity) -> None:
        with session_scope(self.sessions) as s:
            rows = s.execute(
                select(Job.id, Attempt.nodes)
                .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt))
                .where(Job.state.in_(list(ACTIVE)), Attempt.ended_at.is_(None))
            ).all()
        jobs_on: dict[str, set[int]] = {}
        for job_id, nodes in rows:
            for node in nodes or ():
                jobs_on.setdefault(node, set()).add(job_id)
        with session_scope(self.sessions) as s:
            free = decisions.free_capacity(cluster, self._allocations(s))
        free_by_id = {n.node_id: n for n in free.nodes}
        publish(
            ClusterView(
                connected=True,
                nodes=[
                    NodeView(
                        node_id=n.node_id,
                        address=n.address,
                        alive=n.alive,
                        cpus_total=n.cpus,
                        cpus_free=max(free_by_id[n.node_id].cpus, 0)
                        if n.node_id in free_by_id
                        else 0,
                        gpus_total=n.gpus,
                        gpus_free=max(free_by_id[n.node_id].gpus, 0)
                        if n.node_id in free_by_id
                        else 0,
                        jobs=sorted(jobs_on.get(n.node_id, ())),
                    )
                    for n in cluster.nodes
                ],
                dashboard_url=cluster.dashboard_url,
                updated_at=time.time(),
            )
        )


def _error_key(error: str, step: int) -> str:
    # Stored on the attempt so "the same error at the same step" survives a restart.
    return f"{error[-1000:]}@step={step}"


class SchedulerThread:
    """Runs passes on a background thread until `stop()`."""

    def __init__(self, scheduler: Scheduler, interval_s: float) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-scheduler", daemon=True)

    def start(self) -> SchedulerThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scheduler.run_pass()
            except Exception:
                log.exception("scheduler pass failed")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        lease.release(self.scheduler.sessions, holder=self.scheduler.holder)


def start_scheduler_thread(
    settings: Settings, session_factory: sessionmaker[Session], launcher: Launcher | None = None
) -> SchedulerThread:
    """Start the scheduler with the Ray launcher (imported here: only the scheduler needs Ray)."""
    if launcher is None:
        from service.launcher.ray_launcher import RayLauncher

        launcher = RayLauncher(settings)
    scheduler = Scheduler(session_factory=session_factory, launcher=launcher, settings=settings)
    return SchedulerThread(scheduler, settings.scheduler_interval_s).start()
