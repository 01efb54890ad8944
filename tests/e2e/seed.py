"""Job histories written through the service's own functions, for the dashboard to draw.

Jobs are submitted over REST (`POST /v1/jobs`), then their run is played the way the
scheduler records it: `start_attempt`, `set_job_state` (which writes each event),
`record_metrics` and `record_checkpoint` (fenced by attempt), worker log files where the API
reads them. Only timestamps are moved afterwards, so that a run of minutes draws like one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select

from service.jobs import (
    end_attempt,
    get_job,
    record_checkpoint,
    record_event,
    record_metrics,
    set_job_state,
    start_attempt,
)
from service.models import Event, Job, Metric
from service.states import JobState
from tests.e2e.server import ServerHandle

GLOBAL_BATCH = 32
SEQ_LEN = 128


def spec(name: str, **overrides: Any) -> dict[str, Any]:
    """A valid spec (the issue's example, small)."""
    base: dict[str, Any] = {
        "name": name,
        "workload": {
            "name": "gpt",
            "params": {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": SEQ_LEN},
        },
        "strategy": {"kind": "ddp"},
        "scaling": {"min_workers": 1, "max_workers": 4, "cpus_per_worker": 1},
        "training": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 8, "max_steps": 300},
        "checkpoint": {"every_steps": 25, "keep_last": 3},
        "labels": {"team": "nlp"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def loss_at(step: int, seed: int = 0) -> float:
    """The same curve whatever the world size (the service's elastic determinism)."""
    noise = random.Random(step * 7919 + seed).uniform(-0.06, 0.06)
    return round(1.55 + 3.0 * math.exp(-step / 70) + noise, 5)


@dataclass
class Story:
    """What was written, for tests to compare the page against."""

    job_id: int
    metric_steps: list[int] = field(default_factory=list)
    last_loss: float | None = None
    checkpoint_steps: list[int] = field(default_factory=list)


class _Clock:
    """Simulated wall clock: each step takes longer at a smaller world size."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def _step_time(world_size: int, step: int) -> float:
    jitter = random.Random(step).uniform(-0.04, 0.04)
    return round(1.8 / world_size + 0.08 + jitter, 4)


def elastic_job(
    srv: ServerHandle,
    *,
    name: str = "gpt-tiny-elastic",
    max_steps: int = 300,
    stop_at: int | None = 262,
    labels: dict[str, str] | None = None,
    strategy: str = "ddp",
) -> Story:
    """A ddp job at 4 workers that loses a node (2 workers) at step 137, resumes at 2 from its
    step-125 checkpoint, grows back to 4 at step 210 and runs on. It finishes SUCCEEDED when
    `stop_at` is None, else it is left RUNNING at `stop_at`."""
    job_json = srv.submit(
        spec(
            name,
            scaling={"min_workers": 2, "max_workers": 4},
            training={"max_steps": max_steps},
            labels=labels or {"team": "nlp", "size": "tiny"},
            strategy={"kind": strategy},
        )
    )
    job_id = int(job_json["id"])
    story = Story(job_id=job_id)
    end = max_steps if stop_at is None else min(stop_at, max_steps)
    clock = _Clock(datetime.now(timezone.utc) - timedelta(seconds=_duration(end) + 45))
    events_at: list[tuple[Event, datetime]] = []
    metric_at: dict[int, datetime] = {}
    log_lines: dict[int, list[str]] = {}

    def transition(
        job: Job, to: JobState, reason: str, ws: int | None = None, **details: Any
    ) -> None:
        ev = set_job_state(
            srv_session, job, to, reason=reason, world_size=ws, details=details or None
        )
        events_at.append((ev, clock.advance(0.5)))

    def run(job: Job, first: int, last: int, ws: int) -> None:
        points = []
        for step in range(first, last + 1):
            dt = _step_time(ws, step)
            metric_at[step] = clock.advance(dt)
            loss = loss_at(step)
            points.append(
                {
                    "step": step,
                    "loss": loss,
                    "lr": 3e-4 * 0.5 * (1 + math.cos(math.pi * step / max_steps)),
                    "step_time_s": dt,
                    "samples_per_s": round(GLOBAL_BATCH / dt, 2),
                    "tokens_per_s": round(GLOBAL_BATCH * SEQ_LEN / dt, 1),
                    "world_size": ws,
                }
            )
            log_lines.setdefault(job.attempt, []).append(
                f"[rank0] step {step:>5} | loss {loss:.4f} | {dt * 1000:.0f} ms/step "
                f"| world_size {ws}\n"
            )
            story.last_loss = loss
        record_metrics(srv_session, job, attempt=job.attempt, points=points)
        for step in range(first, last + 1):
            if step % 25 == 0:
                checkpoint(job, step, ws)

    def checkpoint(job: Job, step: int, ws: int) -> None:
        record_checkpoint(
            srv_session,
            job,
            attempt=job.attempt,
            step=step,
            world_size=ws,
            path=f"{srv.storage_path}/jobs/{job_id}/checkpoints/step-{step:08d}",
            size_bytes=ws * 3_400_000 + step * 17,
            committed_at=metric_at.get(step, clock.now) + timedelta(seconds=0.3),
        )
        if step not in story.checkpoint_steps:
            story.checkpoint_steps.append(step)

    with srv.session() as srv_session:
        job = get_job(srv_session, job_id)
        # Attempt 1 at 4 workers.
        start_attempt(srv_session, job, world_size=4, driver_name=f"elastrain-job-{job_id}-1")
        transition(job, JobState.STARTING, "admitted: 4 workers fit (min 2)", 4)
        transition(job, JobState.RUNNING, "worker group ready", 4)
        lost_at = min(137, end)
        run(job, 1, lost_at, 4)
        if end > lost_at:
            # A node with 2 workers dies: the job falls back to its step-125 checkpoint at 2.
            ev = record_event(
                srv_session, job, kind="node_lost",
                reason="node 10.0.0.3 lost (ranks 2, 3): heartbeat timed out",
                details={"node_id": "a3f1c9e2d4b5", "ranks": [2, 3]},
            )  # fmt: skip
            events_at.append((ev, clock.advance(1.0)))
            transition(job, JobState.RECOVERING, "node lost: 10.0.0.3 (ranks 2, 3)", 2)
            end_attempt(srv_session, job, number=job.attempt, outcome="node_lost")
            job.restarts += 1
            start_attempt(srv_session, job, world_size=2, driver_name=f"elastrain-job-{job_id}-2")
            clock.advance(6)
            transition(
                job, JobState.STARTING, "relaunching at world size 2 from checkpoint step 125", 2
            )
            transition(
                job, JobState.RUNNING, "resumed from step 125 at world size 2", 2, resume_step=125
            )
            grow_at = min(210, end)
            run(job, 126, grow_at, 2)
            if end > grow_at:
                transition(job, JobState.RESIZING, "scale-up: 2 more workers free for 10s", 2)
                checkpoint(job, grow_at, 2)
                end_attempt(srv_session, job, number=job.attempt, outcome="resized")
                start_attempt(
                    srv_session, job, world_size=4, driver_name=f"elastrain-job-{job_id}-3"
                )
                clock.advance(4)
                transition(
                    job,
                    JobState.STARTING,
                    "relaunching at world size 4 from checkpoint step 210",
                    4,
                )
                transition(
                    job,
                    JobState.RUNNING,
                    "resumed from step 210 at world size 4",
                    4,
                    resume_step=210,
                )
                run(job, grow_at + 1, end, 4)
        if stop_at is None:
            transition(job, JobState.SUCCEEDED, f"reached max_steps ({max_steps})")
            end_attempt(srv_session, job, number=job.attempt, outcome="succeeded")
        srv_session.flush()
        # Spread the timestamps over the simulated run.
        for ev, at in events_at:
            ev.at = at
        first_event = srv_session.scalars(
            select(Event).where(Event.job_id == job_id).order_by(Event.id)
        ).first()
        start = events_at[0][1] - timedelta(seconds=20)
        if first_event is not None and first_event.reason == "submitted":
            first_event.at = start
        job.created_at = start
        job.started_at = events_at[1][1]
        if job.finished_at is not None:
            job.finished_at = events_at[-1][1]
        for metric in srv_session.scalars(select(Metric).where(Metric.job_id == job_id)):
            metric.at = metric_at.get(metric.step, metric.at)
        story.metric_steps = sorted(
            srv_session.scalars(select(Metric.step).where(Metric.job_id == job_id))
        )
    logs = srv.logs_dir(job_id)
    logs.mkdir(parents=True, exist_ok=True)
    for attempt, lines in log_lines.items():
        ws = 4 if attempt != 2 else 2
        header = f"[rank0] attempt {attempt}: world_size={ws} strategy={strategy}\n"
        (logs / f"attempt-{attempt}.rank-0.log").write_text(header + "".join(lines))
    return story


def _duration(steps: int) -> float:
    return sum(_step_time(4, s) for s in range(1, steps + 1)) * 1.3 + 30


def running_job(
    srv: ServerHandle,
    *,
    name: str,
    step: int = 40,
    max_steps: int = 200,
    world_size: int = 2,
    labels: dict[str, str] | None = None,
    **spec_overrides: Any,
) -> int:
    """A RUNNING job with `step` metric points (no checkpoints)."""
    body = spec(name, training={"max_steps": max_steps}, labels=labels or {"team": "nlp"})
    body.update(spec_overrides)
    job_id = int(srv.submit(body)["id"])
    with srv.session() as s:
        job = get_job(s, job_id)
        start_attempt(s, job, world_size=world_size, driver_name=f"elastrain-job-{job_id}-1")
        set_job_state(s, job, JobState.STARTING, reason="admitted", world_size=world_size)
        set_job_state(s, job, JobState.RUNNING, reason="worker group ready", world_size=world_size)
        if step:
            record_metrics(s, job, attempt=job.attempt, points=[
                {"step": i, "loss": loss_at(i, seed=job_id), "step_time_s": 0.5,
                 "samples_per_s": 64.0, "tokens_per_s": 8192.0, "world_size": world_size}
                for i in range(1, step + 1)
            ])  # fmt: skip
    return job_id


def set_state(srv: ServerHandle, job_id: int, to: JobState, reason: str) -> None:
    """Play the scheduler's part for one transition."""
    with srv.session() as s:
        set_job_state(s, get_job(s, job_id), to, reason=reason)


def backdate(srv: ServerHandle, job_id: int, seconds: float) -> None:
    """Move a job's history `seconds` into the past (its age in the list)."""
    delta = timedelta(seconds=seconds)
    with srv.session() as s:
        job = get_job(s, job_id)
        for attr in ("created_at", "started_at", "finished_at"):
            if getattr(job, attr) is not None:
                setattr(job, attr, getattr(job, attr) - delta)
        for ev in s.scalars(select(Event).where(Event.job_id == job_id)):
            ev.at = ev.at - delta


def showcase(srv: ServerHandle) -> Story:
    """A varied list for screenshots: every state, three strategies, one elastic story."""
    done = elastic_job(srv, name="gpt-small-fsdp", stop_at=None, strategy="fsdp",
                       labels={"team": "nlp", "size": "small"})  # fmt: skip
    backdate(srv, done.job_id, 3 * 3600)
    failed = running_job(srv, name="vision-sweep-lr1e-2", step=57, max_steps=400,
                         labels={"team": "vision", "sweep": "lr"})  # fmt: skip
    with srv.session() as s:
        job = get_job(s, failed)
        job.last_error = (
            "rank 1 on 10.0.0.2: FloatingPointError: loss is NaN at step 57 "
            "(learning_rate 0.01); last good checkpoint: none"
        )
        set_job_state(s, job, JobState.FAILED, reason="worker error: loss is NaN at step 57")
    backdate(srv, failed, 2 * 3600)
    cancelled = running_job(srv, name="gpt-tiny-debug", step=12, labels={"team": "nlp"})
    set_state(srv, cancelled, JobState.CANCELLED, "cancelled by user")
    backdate(srv, cancelled, 5400)
    smoke = running_job(srv, name="synthetic-smoke", step=50, max_steps=50,
                        workload={"name": "synthetic"}, labels={"team": "infra"})  # fmt: skip
    set_state(srv, smoke, JobState.SUCCEEDED, "reached max_steps (50)")
    backdate(srv, smoke, 3000)
    pipe = running_job(srv, name="gpt-pipeline-1f1b", step=180, max_steps=1000, world_size=4,
                       strategy={"kind": "pipeline", "pipeline_stages": 2, "schedule": "1f1b"},
                       labels={"team": "nlp", "size": "small"})  # fmt: skip
    backdate(srv, pipe, 1500)
    story = elastic_job(srv)  # RUNNING, lost a node, grew back
    rec = running_job(srv, name="vision-resnet-ddp", step=96, max_steps=500, world_size=2,
                      labels={"team": "vision"})  # fmt: skip
    with srv.session() as s:
        job = get_job(s, rec)
        set_job_state(s, job, JobState.RECOVERING, world_size=1,
                      reason="node lost: 10.0.0.4 (rank 1)")  # fmt: skip
    backdate(srv, rec, 240)
    for name, team in (("gpt-medium-fsdp", "nlp"), ("vision-vit-sweep-3", "vision")):
        job_id = int(srv.submit(spec(name, strategy={"kind": "fsdp"}, labels={"team": team},
                                     scaling={"min_workers": 4, "max_workers": 8}))["id"])  # fmt: skip
        with srv.session() as s:
            job = get_job(s, job_id)
            job.state_reason = "waiting for 4 workers (2 CPUs free)"
    return story
