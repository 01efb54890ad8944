"""The scheduler: a level-triggered loop of observe, decide, execute.

Each pass, holding the DB lease: read every unfinished job and its current attempt, hand
the runtime the live attempts (`Launcher.reconcile`: every live attempt's report comes
back, all at once, no DB transaction open, and the runtime lets go of whatever else it
holds), decide about each job with the pure `elastrain.service.decisions.decide`, and hand the
actions to `elastrain.service.executor.Executor`. Nothing is kept in memory that a restarted control plane could
not rebuild from the DB and the drivers' names, except timers (backoff, growth hysteresis),
which simply start over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import UTC, datetime

from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.messages import DriverReport, DriverStatus
from elastrain.contracts.runtime import AttemptKey, LiveAttempt, Reconcile
from elastrain.contracts.spec import JobSpec
from elastrain.service import (
    admission,
    auth,
    cluster,
    decisions,
    drains,
    identity,
    lease,
    metric_store,
    observe,
    package_access,
    packages,
    reports,
    telemetry,
)
from elastrain.service.capacity import (
    Allocation,
    CapacityLedger,
    ClusterCapacity,
    NodeDrain,
    WorkerShape,
    found_dead,
    target_world_size,
)
from elastrain.service.db import session_scope
from elastrain.service.decisions import Action, Facts, JobView, PersistReport, Policy
from elastrain.service.executor import Executor, Timers
from elastrain.service.isolation import plan_isolating, undecidable_reason
from elastrain.service.launcher import Launcher
from elastrain.service.logs import job_context
from elastrain.service.metric_limits import MetricBudgets
from elastrain.service.settings import Settings
from elastrain.service.tracking import tracker_maker
from elastrain.service.tracking.forwarder import Forwarder, ForwarderThread

log = logging.getLogger("elastrain.scheduler")

LEASE_TTL_S = 10.0
#: How long a node that left is remembered (`track_gone`): longer than an attempt waits for
#: its placement (the runtime gives up after 120 s), whose release it decides.
GONE_HOLD_S = 600.0
#: How often unused packages are looked for (a folder listing of the storage root).
PACKAGE_SWEEP_INTERVAL_S = 600.0


class Scheduler:
    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        launcher: Launcher,
        settings: Settings,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sessions = session_factory
        self.launcher = launcher
        self.settings = settings
        self.holder = holder or lease.holder_name()
        self.clock = clock
        self.policy = Policy(
            grow_interval_s=settings.grow_interval_s,
            below_min_timeout_s=settings.below_min_timeout_s,
            restart_backoff_s=settings.restart_backoff_s,
        )
        self.timers = Timers()
        self.lease = lease.LeaseKeeper(session_factory, holder=self.holder, ttl_s=LEASE_TTL_S)
        self._published: cluster.ClusterView | None = None
        self._published_at = 0.0
        self._swept_at = 0.0
        self._tenure = 0
        self._database: str | None = None  # this database's identity, read once
        self._draining: dict[str, NodeDrain] = {}  # this pass's draining nodes
        self._found_dead: dict[str, float] = {}  # nodes dead before Ray says so, until when
        self._alive_before: frozenset[str] | None = None  # the last pass's alive nodes
        self._gone: dict[str, float] = {}  # nodes that left since, and when (`track_gone`)
        # The views (and parsed specs) of the jobs each pass reads, kept between passes.
        self._active_views = observe.ViewCache()
        self._pending_views = observe.ViewCache()
        self.executor = Executor(
            sessions=session_factory,
            launcher=launcher,
            storage_path=settings.storage_path,
            timers=self.timers,
            # What jobs report is bounded where it is stored (`service/metric_limits.py`).
            metric_budgets=MetricBudgets(settings.metric_limits, clock),
            tenant_users=settings.tenant_identities,
        )

    def run_pass(self) -> bool:
        """One pass. Returns False when another scheduler holds the lease."""
        if not self.lease.hold():
            return False
        if self.lease.tenure != self._tenure:
            # Another scheduler may have held the lease meanwhile: what the executor
            # remembers of jobs' metric summaries may no longer be what is stored.
            self.executor.buckets.clear()
            if self.executor.metric_budgets is not None:
                self.executor.metric_budgets.clear()
            self._tenure = self.lease.tenure
        with telemetry.SCHEDULER_PASS.time():
            self._pass()
        return True

    def _pass(self) -> None:
        capacity = self.launcher.capacity()
        observed_at = time.time()  # wall clock, as the runtime client stamps launches
        with session_scope(self.sessions) as s:
            if self._database is None:
                self._database = identity.database_id(s)
            active = observe.active_jobs(s, cache=self._active_views)
            pending = observe.pending_jobs(s, cache=self._pending_views)
            unreadable = {**self._active_views.unreadable, **self._pending_views.unreadable}
            quotas = Quotas(auth.quotas(s), self.settings.default_max_workers_per_tenant, active)
            capacity, self._draining = drains.effective(capacity, drains.stored(s))
        for job_id, reason in unreadable.items():
            self._give_up(job_id, reason)
        self.executor.buckets.keep_only(job.id for job in active)
        ids = {job.id for job in active}
        self.timers.kept_off = {j: k for j, k in self.timers.kept_off.items() if j in ids}
        if self.executor.metric_budgets is not None:
            self.executor.metric_budgets.keep_only(job.id for job in active)
        polled = self._reconcile(active, pending, observed_at)
        self._found_dead = found_dead(
            self._found_dead, polled.values(), capacity.alive_ids(), self.clock()
        )
        capacity = capacity.with_dead(self._found_dead)
        alive = capacity.alive_ids()
        self._gone = track_gone(self._gone, self._alive_before, alive, now=observed_at)
        self._alive_before = alive
        ledger = CapacityLedger(capacity, _held(active))
        steady: list[tuple[JobView, PersistReport]] = []
        for job in active:
            with _about(job):
                try:
                    actions = self._decide_active(
                        job, ledger, polled.get(job.id), others_waiting=bool(pending),
                        quotas=quotas,
                    )  # fmt: skip
                except Exception as exc:  # this job's problem, not the pass's
                    log.exception("job %s: deciding about it raised", job.id)
                    self._give_up(job.id, undecidable_reason(exc))
                    continue
                if (report := _steady_report(job, actions)) is not None:
                    steady.append((job, report))  # stored with the others' below
                elif self.executor.execute(job, actions):
                    ledger.hold(job.id, decisions.allocation_after(job, actions))
        self.executor.execute_steady(steady)
        free, quota_left = ledger.free(), quotas.left(ledger, {j.owner for j in pending})
        usage = quotas.usage(ledger)
        planned = plan_isolating(
            lambda jobs: admission.plan_admissions(
                jobs,
                free,
                capacity,
                quota_left,
                usage=usage,
                now=observed_at,
                reserve_after_s=self.settings.queue_reserve_after_s,
            ),
            pending,
        )
        for job_id, reason in planned.broken.items():
            self._give_up(job_id, reason)
        sizes = {a.job_id: a.world_size for a in planned.admissions}
        reasons = {w.job_id: w.reason for w in planned.waiting}
        for job in pending:
            if job.id in planned.broken:
                continue
            with _about(job):
                try:
                    facts = self._facts(
                        job, ledger, admission=sizes.get(job.id), waiting_reason=reasons.get(job.id)
                    )
                    actions = decisions.decide(job, facts)
                except Exception as exc:
                    log.exception("job %s: deciding about it raised", job.id)
                    self._give_up(job.id, undecidable_reason(exc))
                    continue
                # Most queued jobs wait on, for the same reason: nothing to carry out or hold.
                if actions and self.executor.execute(job, actions):
                    ledger.hold(job.id, decisions.allocation_after(job, actions))
        self._publish(capacity, ledger)
        self._sweep([*active, *pending])

    def _give_up(self, job_id: int, reason: str) -> None:
        """Fail a job the scheduler cannot decide about, saying which and why in the log."""
        with job_context(job_id=job_id):
            log.error("job %s: failed, the scheduler cannot decide about it: %s", job_id, reason)
            self.executor.give_up_on(job_id, reason)

    def _sweep(self, unfinished: list[JobView]) -> None:
        """Now and then: delete uploaded packages nothing uses any more, and thin the
        metric rows of jobs finished long ago (when the settings ask for it)."""
        now = self.clock()
        if now - self._swept_at < PACKAGE_SWEEP_INTERVAL_S:
            return
        self._swept_at = now
        self._sweep_packages(unfinished, now)
        self._thin_metrics(now)

    def _sweep_packages(self, unfinished: list[JobView], now: float) -> None:
        in_use = {p for job in unfinished if (p := job.spec.workload.package) is not None}
        keep_s = self.settings.package_keep_days * 86400
        deleted = packages.sweep(self.settings.storage_path, in_use, now=now, keep_s=keep_s)
        for digest in deleted:
            log.info(
                "deleted package %s: unused for %g days", digest, self.settings.package_keep_days
            )
        if deleted:  # nobody holds them now, and they no longer count against quotas
            with session_scope(self.sessions) as s:
                package_access.forget(s, deleted)

    def _thin_metrics(self, now: float) -> None:
        days = self.settings.metrics_thin_after_days
        if days is None:
            return
        before = datetime.fromtimestamp(now - days * 86400, tz=UTC)
        with session_scope(self.sessions) as s:
            # A few jobs per sweep: each is a bounded amount of work under no job lock
            # (finished jobs are written by nobody).
            for job in metric_store.jobs_to_thin(s, finished_before=before, limit=10):
                deleted = metric_store.thin(s, job, now=datetime.fromtimestamp(now, tz=UTC))
                log.info("thinned job %s's metrics: %d per-step rows deleted", job.id, deleted)

    def _decide_active(
        self,
        job: JobView,
        ledger: CapacityLedger,
        report: DriverReport | None,
        *,
        others_waiting: bool,
        quotas: Quotas,
    ) -> list[Action]:
        if report is not None and report.status in (DriverStatus.FAILED, DriverStatus.LOST):
            with session_scope(self.sessions) as s:  # read only when a failure needs it
                job = replace(job, failures=observe.failure_history(s, job.id))
        limit = quotas.limit_for(job, ledger)
        kept = self._kept_off(job, ledger, report, limit)
        facts = self._facts(
            job, ledger, report=report, others_waiting=others_waiting, worker_limit=limit,
            kept_off=kept,
        )  # fmt: skip
        return decisions.decide(job, facts)

    def _kept_off(
        self, job: JobView, ledger: CapacityLedger, report: DriverReport | None, limit: int | None
    ) -> dict[str, float]:
        """The nodes the job keeps off now (`failure.stragglers: evict`): a straggler's node
        is left only where the job still holds its min workers without it."""
        before = self.timers.kept_off.get(job.id, {})
        slow = report.slow_nodes if report is not None else ()
        kept = drains.keep_off(job.spec.failure, slow, before, now=self.clock())
        if kept.keys() - before.keys():
            without, _ = drains.effective(ledger.free_for(job.id), drains.kept_off_drains(kept))
            if target_world_size(job.spec, without, limit=limit) < job.spec.min_world_size:
                kept = {n: t for n, t in kept.items() if n in before}  # stays: nowhere else
        if kept:
            self.timers.kept_off[job.id] = kept
        else:
            self.timers.kept_off.pop(job.id, None)
        return kept

    def _facts(
        self,
        job: JobView,
        ledger: CapacityLedger,
        *,
        report: DriverReport | None = None,
        others_waiting: bool = False,
        admission: int | None = None,
        waiting_reason: str | None = None,
        worker_limit: int | None = None,
        kept_off: dict[str, float] | None = None,
    ) -> Facts:
        free, draining = ledger.free_for(job.id), self._draining
        if kept_off:  # this job's own drains: it leaves those nodes, and is placed elsewhere
            free, own = drains.effective(free, drains.kept_off_drains(kept_off))
            draining = {**draining, **own}
        # Built once with every field (not copied with `replace` for the last ones): a pass
        # builds the facts of every queued job.
        return Facts(
            now=self.clock(),
            policy=self.policy,
            alive_nodes=ledger.cluster.alive_ids(),
            free=free,
            report=report,
            relaunch_not_before=self.timers.relaunch_not_before.get(job.id, 0.0),
            spare_since=self.timers.spare_since.get(job.id),
            others_waiting=others_waiting,
            admission=admission,
            waiting_reason=waiting_reason,
            worker_limit=worker_limit,
            worker_memory_bytes=self._worker_memory(job.spec, ledger.cluster),
            draining=draining,
            nodes_gone=self._gone,
        )

    def _worker_memory(self, spec: JobSpec, capacity: ClusterCapacity) -> int | None:
        """What one worker has for an `auto` job's plan: the operator's figure, else (CPU
        workers) their share of the poorest node's memory; Ray does not say a GPU's."""
        if self.settings.worker_memory_bytes is not None:
            return self.settings.worker_memory_bytes
        if spec.scaling.use_gpu:
            return None
        return capacity.worker_memory_bytes(spec.scaling.cpus_per_worker)

    def _reconcile(
        self, active: list[JobView], pending: list[JobView], observed_at: float
    ) -> dict[int, DriverReport]:
        """The live attempts' reports; the runtime lets go of everything else."""
        assert self._database is not None
        want = Reconcile(
            database=self._database,
            attempts={
                AttemptKey(job.id, attempt.number): LiveAttempt(
                    name=attempt.name, ack=attempt.report_seq
                )
                for job in active
                if (attempt := job.live_attempt) is not None
            },
            keep_jobs=frozenset(job.id for job in (*active, *pending)),
            observed_at=observed_at,
        )
        return {key.job_id: report for key, report in self.launcher.reconcile(want).items()}

    def _publish(self, capacity: ClusterCapacity, ledger: CapacityLedger) -> None:
        with session_scope(self.sessions) as s:
            view = cluster.snapshot(
                capacity, ledger.free(), observe.placed_jobs(s), draining=self._draining
            )
            # Unchanged views are rewritten only now and then: often enough that readers
            # see a fresh snapshot (connected), rarely enough to cost the DB nothing.
            same = replace(view, updated_at=None) == self._published
            if same and self.clock() - self._published_at < cluster.STALE_AFTER_S / 3:
                return
            cluster.publish(s, view)
        self._published, self._published_at = replace(view, updated_at=None), self.clock()


def track_gone(
    gone: Mapping[str, float], before: frozenset[str] | None, alive: frozenset[str], *, now: float
) -> dict[str, float]:
    """The nodes that left the alive ones (Ray's, less those counted dead: `found_dead`),
    each with when it was first seen gone (`now`: wall clock, as attempts' `started_at`),
    for GONE_HOLD_S; one alive again (a `found_dead` hold that ran out) is forgotten.
    `before`: the previous pass's alive nodes (None on the first pass: what left before
    this scheduler watched is not known, and an attempt waiting for its placement then
    times out in the runtime). Pure."""
    out = {node: at for node, at in gone.items() if node not in alive and now - at < GONE_HOLD_S}
    for node in (before or frozenset()) - alive:
        out.setdefault(node, now)
    return out


def _steady_report(job: JobView, actions: Sequence[Action]) -> PersistReport | None:
    """The report, when storing it is all there is to do about `job` this pass and it holds
    training steps only (what a running job sends every pass): those are stored together."""
    if len(actions) != 1 or not isinstance(action := actions[0], PersistReport):
        return None
    attempt = job.live_attempt
    placed = attempt is not None and bool(attempt.nodes)
    return action if reports.is_steady(action.report, placed=placed) else None


def _about(job: JobView) -> AbstractContextManager[None]:
    """Log lines written while handling `job` carry its id, attempt and tenant."""
    attempt = job.attempt.number if job.attempt is not None else None
    return job_context(job_id=job.id, attempt=attempt, tenant=job.owner)


class Quotas:
    """Tenants' worker quotas during one pass: what each may still take, given what the
    ledger says their jobs hold."""

    def __init__(
        self, own: dict[str, int | None], default: int | None, active: list[JobView]
    ) -> None:
        self.own = own
        self.default = default
        self.jobs_of: dict[str, list[int]] = {}
        for job in active:
            self.jobs_of.setdefault(job.owner, []).append(job.id)

    def quota(self, tenant: str) -> int | None:
        own = self.own.get(tenant)
        return own if own is not None else self.default

    def limit_for(self, job: JobView, ledger: CapacityLedger) -> int | None:
        """The most workers `job` may hold: its tenant's quota less its other jobs'."""
        quota = self.quota(job.owner)
        if quota is None:
            return None
        others = [j for j in self.jobs_of.get(job.owner, []) if j != job.id]
        return max(0, quota - ledger.workers_held(others))

    def usage(self, ledger: CapacityLedger) -> dict[str, admission.Usage]:
        """What each tenant's live jobs hold (its dominant share: `elastrain.service.admission`)."""
        return {
            tenant: admission.Usage(cpus=cpus, gpus=gpus)
            for tenant, ids in self.jobs_of.items()
            for cpus, gpus in [ledger.resources_held(ids)]
        }

    def left(self, ledger: CapacityLedger, tenants: set[str]) -> dict[str, int | None]:
        return {
            t: None if (q := self.quota(t)) is None
            else max(0, q - ledger.workers_held(self.jobs_of.get(t, [])))
            for t in tenants
        }  # fmt: skip


def _held(active: list[JobView]) -> dict[int, Allocation]:
    return {
        job.id: Allocation(
            shape=WorkerShape.of(job.spec), count=attempt.world_size, nodes=attempt.nodes
        )
        for job in active
        if (attempt := job.live_attempt) is not None
    }


class SchedulerThread:
    """Runs passes on a background thread until `stop()`."""

    def __init__(self, scheduler: Scheduler, interval_s: float) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-scheduler", daemon=True)
        # Experiment trackers are fed on a thread of their own: a slow tracker never holds
        # up a pass. It forwards only while this scheduler holds the lease.
        self.tracking = ForwarderThread(
            Forwarder(scheduler.sessions, make=tracker_maker(scheduler.settings)),
            scheduler.settings.tracking_interval_s,
            leading=scheduler.lease.held_now,
        )

    def start(self) -> SchedulerThread:
        self._thread.start()
        self.tracking.start()
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
        self.tracking.stop()
        self._thread.join(timeout=30)
        self.scheduler.lease.release()


def start_scheduler_thread(
    settings: Settings, session_factory: sessionmaker[Session], launcher: Launcher | None = None
) -> SchedulerThread:
    """Start the scheduler with the runtime on Ray (imported here: only the scheduler needs
    Ray)."""
    if launcher is None:
        from elastrain.service.runtime_client import RuntimeClient

        launcher = RuntimeClient(settings, identity.runtime_control_key(session_factory))
    scheduler = Scheduler(session_factory=session_factory, launcher=launcher, settings=settings)
    return SchedulerThread(scheduler, settings.scheduler_interval_s).start()
