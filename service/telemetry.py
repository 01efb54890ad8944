"""Prometheus metrics: what the control plane counts as it works, and what the database
says at scrape time.

Two sources, one `/metrics` page:

- **Counters and histograms of events** (starts and recoveries and their seconds, node
  losses, restarts, checkpoints, scheduler passes) live in this process's registry. The
  executor derives `Sample`s from the actions it applied (`samples_for`, pure) and records
  them once the transaction has committed. They restart from zero with the process, as
  Prometheus counters may: `rate()` and `increase()` handle resets.
- **Gauges of state** (jobs by state and tenant, the queue and its oldest wait, each active
  job's steps/s, tokens/s, world size and goodput) are read from the database on every
  scrape (`DatabaseCollector`), so every API replica serves the same numbers, with or
  without a scheduler in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from elastrain.contracts.messages import (
    CheckpointCommitted,
    DriverReport,
    EventKind,
    Phase,
    SavedTraining,
    StepMetrics,
    Timeline,
)
from elastrain.service import goodput
from elastrain.service.decisions import (
    Action,
    AttemptOutcome,
    EndAttempt,
    PersistReport,
    Transition,
)
from elastrain.service.models import Event, Job, as_utc, utcnow
from elastrain.service.models import Metric as MetricRow
from elastrain.service.states import ACTIVE, JobState

REGISTRY = CollectorRegistry(auto_describe=True)

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_QUEUE = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
_PASS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

SCHEDULER_PASS = Histogram(
    "elastrain_scheduler_pass_seconds", "Duration of one scheduler pass.", buckets=_PASS,
    registry=REGISTRY,
)  # fmt: skip
QUEUE_WAIT = Histogram(
    "elastrain_queue_wait_seconds", "Submission to admission, per admitted job.",
    ["tenant"], buckets=_QUEUE, registry=REGISTRY,
)  # fmt: skip
STARTS = Histogram(
    "elastrain_start_seconds",
    "From what started an attempt (submission, node lost, failure, grow decision; a grow "
    "onto a node that joined: the join) to its first step: the recovery time when cause is "
    "'node lost' or 'failed'.",
    ["cause"], buckets=_SECONDS, registry=REGISTRY,
)  # fmt: skip
RESTORES = Histogram(
    "elastrain_state_restore_seconds",
    "Restoring training state at an attempt's start, by source (checkpoint load, peer memory).",
    ["source"], buckets=_SECONDS, registry=REGISTRY,
)  # fmt: skip
NODE_LOSSES = Counter(
    "elastrain_node_losses_total", "Attempts ended because a node holding a rank was lost.",
    ["tenant"], registry=REGISTRY,
)  # fmt: skip
RESTARTS = Counter(
    "elastrain_restarts_total", "Attempts that failed and counted against max_restarts.",
    ["tenant"], registry=REGISTRY,
)  # fmt: skip
FINISHED = Counter(
    "elastrain_jobs_finished_total", "Jobs that reached a final state.", ["state", "tenant"],
    registry=REGISTRY,
)  # fmt: skip
METRIC_POINTS_LIMITED = Counter(
    "elastrain_metric_points_limited_total",
    "Metric points a job reported past a limit (ELASTRAIN_METRIC_*), dropped or trimmed; "
    "by kind of limit only (the job is named in its events).",
    ["limit"], registry=REGISTRY,
)  # fmt: skip
CHECKPOINTS = Counter(
    "elastrain_checkpoints_total", "Checkpoints committed.", ["tenant"], registry=REGISTRY
)
CHECKPOINT_BYTES = Counter(
    "elastrain_checkpoint_bytes_total", "Bytes of committed checkpoints.", ["tenant"],
    registry=REGISTRY,
)  # fmt: skip
CHECKPOINT_SAVE = Histogram(
    "elastrain_checkpoint_save_seconds",
    "A checkpoint save from its start to its commit (async saves overlap training).",
    buckets=_SECONDS, registry=REGISTRY,
)  # fmt: skip
CHECKPOINT_STALL = Histogram(
    "elastrain_checkpoint_stall_seconds", "Training blocked by a checkpoint save.",
    buckets=_SECONDS, registry=REGISTRY,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Sample:
    """One observation: a histogram `observe` or a counter `inc`, with its labels."""

    metric: Histogram | Counter
    labels: tuple[str, ...]
    value: float


def samples_for(job: Job, actions: Sequence[Action], *, now: datetime) -> list[Sample]:
    """What applying `actions` to `job` (as it was before) counts. Pure but for `job`'s
    attribute reads."""
    tenant = job.owner
    out: list[Sample] = []
    for action in actions:
        if isinstance(action, Transition):
            if job.state == JobState.PENDING and action.to == JobState.STARTING:
                waited = (now - as_utc(job.created_at)).total_seconds()
                out.append(Sample(QUEUE_WAIT, (tenant,), max(0.0, waited)))
            if action.to.is_terminal:
                out.append(Sample(FINISHED, (action.to.value, tenant), 1))
        elif isinstance(action, EndAttempt):
            if action.outcome == AttemptOutcome.NODE_LOST:
                out.append(Sample(NODE_LOSSES, (tenant,), 1))
            elif action.count_restart:
                out.append(Sample(RESTARTS, (tenant,), 1))
        elif isinstance(action, PersistReport):
            out.extend(report_samples(action.report, tenant=tenant))
    return out


def report_samples(report: DriverReport, *, tenant: str) -> list[Sample]:
    """What storing `report` of a job of `tenant` counts."""
    return list(_report_samples(report.messages, tenant))


def _report_samples(messages: Iterable[object], tenant: str) -> Iterator[Sample]:
    for message in messages:
        if isinstance(message, CheckpointCommitted):
            yield Sample(CHECKPOINTS, (tenant,), 1)
            yield Sample(CHECKPOINT_BYTES, (tenant,), float(message.bytes))
            seconds = _save_seconds(message.manifest)
            if seconds is not None:
                yield Sample(CHECKPOINT_SAVE, (), seconds)
        elif isinstance(message, Timeline):
            yield Sample(STARTS, (message.cause,), message.total_s)
            for mark, phase in zip(message.marks, message.phases(), strict=True):
                # A fresh start (no source) restored nothing: not a restore to time.
                if mark.phase == Phase.STATE_RESTORED and mark.source is not None:
                    yield Sample(RESTORES, (mark.source.value,), float(phase["seconds"]))
        elif isinstance(message, StepMetrics):
            stall = message.checkpoint_stall_s or 0.0
            if stall > 0:
                yield Sample(CHECKPOINT_STALL, (), stall)


def _save_seconds(manifest: dict[str, Any] | None) -> float | None:
    if not manifest:
        return None
    started = SavedTraining.from_extra(manifest.get("extra")).save_started_at
    committed = manifest.get("created_at")
    if isinstance(started, int | float) and isinstance(committed, int | float):
        return max(0.0, float(committed) - float(started))
    return None


def record(samples: Iterable[Sample]) -> None:
    for sample in samples:
        metric = sample.metric.labels(*sample.labels) if sample.labels else sample.metric
        if isinstance(metric, Histogram):
            metric.observe(sample.value)
        else:
            metric.inc(sample.value)


# ---------------------------------------------------------------------------------------
# Read from the database at scrape time
# ---------------------------------------------------------------------------------------

#: Per-job series for at most this many active jobs (the newest): bounded cardinality.
MAX_JOB_SERIES = 500


class DatabaseCollector(Collector):
    def __init__(self, session: Session) -> None:
        self.session = session

    def collect(self) -> Iterator[Metric]:
        now = utcnow()
        by_state = GaugeMetricFamily(
            "elastrain_jobs", "Jobs by state and tenant.", labels=["state", "tenant"]
        )
        rows = self.session.execute(
            select(Job.state, Job.owner, func.count()).group_by(Job.state, Job.owner)
        ).all()
        for state, tenant, count in rows:
            by_state.add_metric([JobState(state).value, tenant], count)
        yield by_state

        pending = self.session.execute(
            select(func.count(), func.min(Job.created_at)).where(Job.state == JobState.PENDING)
        ).one()
        yield GaugeMetricFamily(
            "elastrain_queue_length", "Jobs waiting for admission.", value=pending[0]
        )
        oldest = (now - as_utc(pending[1])).total_seconds() if pending[1] is not None else 0.0
        yield GaugeMetricFamily(
            "elastrain_queue_oldest_wait_seconds",
            "How long the longest-waiting queued job has waited (0: none queued).",
            value=max(0.0, oldest),
        )
        yield from self._active_jobs(now)

    def _active_jobs(self, now: datetime) -> Iterator[Metric]:
        labels = ["job_id", "tenant"]
        families = {
            "steps": GaugeMetricFamily(
                "elastrain_job_steps_per_second", "Optimizer steps per second, newest step.",
                labels=labels,
            ),
            "tokens": GaugeMetricFamily(
                "elastrain_job_tokens_per_second", "Training tokens per second, newest step.",
                labels=labels,
            ),
            "world": GaugeMetricFamily(
                "elastrain_job_world_size", "Workers of the job's current attempt.",
                labels=labels,
            ),
            "goodput": GaugeMetricFamily(
                "elastrain_job_goodput_ratio",
                "Share of the job's wall time spent on training steps it kept.", labels=labels,
            ),
            "stragglers": GaugeMetricFamily(
                "elastrain_job_stragglers",
                "Ranks of the job's current attempt found slower than their peers "
                "(failure.stragglers).", labels=labels,
            ),
        }  # fmt: skip
        rows = self.session.execute(
            select(Job, MetricRow.values)
            .outerjoin(MetricRow, and_(MetricRow.job_id == Job.id, MetricRow.step == Job.step))
            .where(Job.state.in_(list(ACTIVE)))
            .order_by(Job.id.desc())
            .limit(MAX_JOB_SERIES)
        ).all()
        stragglers = self._stragglers([job.id for job, _ in rows])
        for job, values in rows:
            key = [str(job.id), job.owner]
            families["stragglers"].add_metric(key, stragglers.get(job.id, 0))
            values = values or {}
            step_time = values.get("step_time_s")
            if isinstance(step_time, int | float) and step_time > 0:
                families["steps"].add_metric(key, 1.0 / step_time)
            tokens = values.get("tokens_per_s")
            if isinstance(tokens, int | float):
                families["tokens"].add_metric(key, tokens)
            families["world"].add_metric(key, job.world_size or 0)
            ratio = goodput.of_job(job, now=now).ratio
            if ratio is not None:
                families["goodput"].add_metric(key, ratio)
        yield from families.values()

    def _stragglers(self, job_ids: list[int]) -> dict[int, int]:
        """Straggler events of each job's current attempt (one per rank found)."""
        rows = self.session.execute(
            select(Event.job_id, func.count())
            .join(Job, and_(Job.id == Event.job_id, Job.attempt == Event.attempt))
            .where(Event.kind == EventKind.STRAGGLER.value, Event.job_id.in_(job_ids))
            .group_by(Event.job_id)
        ).all()
        return {job_id: count for job_id, count in rows}


def exposition(session_factory: Callable[[], Session]) -> bytes:
    """The `/metrics` page: this process's counters, then the database's gauges."""
    scrape = CollectorRegistry(auto_describe=False)
    with session_factory() as session:
        scrape.register(DatabaseCollector(session))
        return generate_latest(REGISTRY) + generate_latest(scrape)
