"""Job histories for the dashboard, produced by the real scheduler.

Jobs are submitted over REST (`POST /v1/jobs`). Everything that happens to them afterwards
is decided and written by the real control plane: `elastrain.service.scheduler.Scheduler` stepping
passes against the server's database (`elastrain.service.decisions` -> `elastrain.service.executor` ->
`elastrain.service.jobs`), with a `FakeLauncher` as the Ray cluster. This module only plays the parts
around it:

- the cluster: nodes join (`add_node`), die (`remove_node`), and the nodes of a finished
  job leave the cluster;
- the drivers and workers (`FakeDriver`): placement, metric points, checkpoint commits
  (their folders and manifests are written where the workers write them,
  `elastrain.checkpoints.layout.step_dir`, so the scheduler's retention really runs), resumes from
  the latest good checkpoint on disk, errors, success;
- the worker logs, written where and as the workers write them
  (`JobStorage.log_file(attempt=, rank=0)`, `elastrain.workers.loop`'s format).

Only timestamps are moved afterwards, so that a run of minutes draws like one: every pass
of a seeding is given a simulated time, and once it is done the rows of its jobs (events,
attempts, metrics, checkpoints, the job's own times) are moved to those times, the run
ending a few seconds ago. The seconds each job spent in each state (its goodput, with the
simulated `step_time_s` and `checkpoint_stall_s` of the points the drivers report) are
then added up again from the moved transitions.

One simulated cluster per server (the e2e server from `uvicorn_argv` runs the API alone, so
this scheduler is the only one). Every seeded job gets nodes of its own, exactly as many as
it is meant to run on, so that jobs never compete for capacity and no job grows unless a
story adds a node for it. A job that a test submitted and left PENDING would stay at the
head of the queue and, gang admission having no backfill, block every job behind it: before
each seeding such jobs are given nodes and admitted like any other (they then stay
STARTING: nobody plays their drivers).

The helpers that act on a job a test already shows (`train`, `fail`, `scheduler_pass`) keep
the real time.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select

from elastrain.checkpoints.catalog import find_latest_good
from elastrain.checkpoints.integrity import describe_files
from elastrain.checkpoints.layout import DCP_METADATA_NAME, step_dir
from elastrain.checkpoints.manifest import Manifest, read_manifest, write_manifest
from elastrain.contracts.messages import (
    DriverStatus,
    EventKind,
    Phase,
    RestoreSource,
    StepMetrics,
    Timeline,
    TimelineMark,
    WorkerError,
)
from elastrain.contracts.spec import JobSpec, StrategyKind
from elastrain.contracts.storage import JobStorage
from elastrain.service import observe
from elastrain.service.capacity import NodeCapacity, WorkerShape
from elastrain.service.jobs import get_job
from elastrain.service.models import Attempt, CheckpointRecord, Event, Job, Metric
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from elastrain.service.states import JobState
from tests.e2e.server import ServerHandle
from tests.fake_launcher import FakeDriver, FakeLauncher

GLOBAL_BATCH = 32
SEQ_LEN = 128

#: The seeding scheduler's growth hysteresis (seconds of its clock, moved by hand).
GROW_INTERVAL_S = 5.0
#: `elastrain.workers.loop.LOG_EVERY_STEPS` (not imported: that module imports torch).
LOG_EVERY_STEPS = 10
#: Simulated seconds between scheduler passes while a job trains (at least one step each).
PASS_INTERVAL_S = 1.0
#: Where a seeded run ends, in seconds before the real now.
END_MARGIN_S = 8.0
#: Simulated delays: queued -> admitted, launched -> worker group placed, placed -> step 1
#: (of the order bench/elastic_bench.py measures with warm worker processes).
QUEUE_S = 3.0
LAUNCH_S = 0.3
FIRST_STEP_S = 0.6
#: Where the launch's seconds go (`LAUNCH_S`): each phase of an attempt's start, reached
#: this many seconds after the worker group began to come up (its timeline).
LAUNCH_PHASES = (
    (Phase.OLD_GROUP_STOPPED, 0.05),
    (Phase.PLACED, 0.2),
    (Phase.PROCESSES_UP, 0.22),
    (Phase.GROUP_FORMED, 0.25),
)

#: The elastic story: the node holding ranks 2 and 3 dies after this step...
LOST_AT = 137
#: ...and the job grows back to 4 workers with a checkpoint at this one.
GROW_AT = 210


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


def _step_time(world_size: int, step: int) -> float:
    """Simulated seconds per step: longer at a smaller world size."""
    jitter = random.Random(step).uniform(-0.04, 0.04)
    return round(1.8 / world_size + 0.08 + jitter, 4)


@dataclass
class Story:
    """What was written, for tests to compare the page against."""

    job_id: int
    metric_steps: list[int] = field(default_factory=list)
    last_loss: float | None = None
    checkpoint_steps: list[int] = field(default_factory=list)
    """The checkpoints the catalogue still lists (retention keeps `keep_last`)."""
    lost_node: str | None = None
    """The node that died (it held ranks 2 and 3)."""


# ---------------------------------------------------------------------------------------
# The simulated cluster and its scheduler (one per server)
# ---------------------------------------------------------------------------------------


class _SchedulerClock:
    """The scheduler's clock (`Scheduler(clock=...)`). It starts at the real time (the DB's
    timestamps, such as when a wait below min began, are compared with it), catches up with
    it at each seeding, and is moved on by hand when a story needs the scheduler to see
    time pass (growth waits `grow_interval_s`)."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def catch_up(self) -> None:
        self.t = max(self.t, time.time())

    def advance(self, seconds: float) -> None:
        self.t += seconds


class _Sim:
    def __init__(self, srv: ServerHandle) -> None:
        self.srv = srv
        self.settings = Settings(
            database_url=srv.database_url,
            storage_path=srv.storage_path,
            grow_interval_s=GROW_INTERVAL_S,
            restart_backoff_s=0,
        )
        self.launcher = FakeLauncher({})  # an empty cluster: nodes join as jobs need them
        self.clock = _SchedulerClock()
        self.scheduler = Scheduler(
            session_factory=srv.session_factory,
            launcher=self.launcher,
            settings=self.settings,
            clock=self.clock,
        )
        self.nodes_of: dict[int, list[str]] = {}
        self.plays: dict[int, _Play] = {}
        self._nodes_made = 0

    # -- the cluster ----------------------------------------------------------------------
    def add_nodes(self, job_id: int, shape: WorkerShape, count: int, per_node: int) -> list[str]:
        """`count` nodes for `job_id`, each holding `per_node` workers of `shape`."""
        made = []
        for _ in range(count):
            self._nodes_made += 1
            # Ray node ids are 56 hex digits; deterministic here, for stable screenshots.
            node_id = hashlib.sha224(f"elastrain-e2e-node-{self._nodes_made}".encode()).hexdigest()
            cpus, gpus = shape.cpus * per_node, shape.gpus * per_node
            self.launcher.add_node(node_id, cpus, gpus=gpus)
            made.append(node_id)
        self.nodes_of.setdefault(job_id, []).extend(made)
        return made

    def alive_nodes(self, job_id: int) -> list[NodeCapacity]:
        nodes = self.launcher.nodes
        return [nodes[n] for n in self.nodes_of.get(job_id, []) if n in nodes and nodes[n].alive]

    def _retire_finished(self) -> None:
        """The nodes of a finished job leave the cluster (its capacity is no one's)."""
        if not self.nodes_of:
            return
        with self.srv.session() as s:
            done = set(
                s.scalars(
                    select(Job.id).where(
                        Job.id.in_(list(self.nodes_of)),
                        Job.state.in_([st for st in JobState if st.is_terminal]),
                    )
                )
            )
        for job_id in done:
            for node_id in self.nodes_of.pop(job_id):
                node = self.launcher.nodes.get(node_id)
                if node is not None and node.alive:
                    del self.launcher.nodes[node_id]

    # -- the scheduler --------------------------------------------------------------------
    def run_pass(self, run: _Run | None = None) -> None:
        if run is not None:
            run.mark()
        if not self.scheduler.run_pass():
            raise RuntimeError("another scheduler holds the lease on this database")
        self._retire_finished()

    def _settle(self) -> None:
        """Before seeding: check that every active job is one this cluster runs, and admit
        the jobs left PENDING (they would block the queue) on nodes of their own."""
        self.clock.catch_up()
        with self.srv.session() as s:
            active = observe.active_jobs(s)
            pending = observe.pending_jobs(s)
        strangers = [
            j.id
            for j in active
            if (a := j.live_attempt) is not None and (j.id, a.number) not in self.launcher.drivers
        ]
        if strangers:
            raise RuntimeError(
                f"jobs {strangers} are active but were not launched by this seed's scheduler "
                "(written directly into the database?): it would see their drivers as lost"
            )
        if not pending:
            return
        for job in pending:
            shape = WorkerShape.of(job.spec)
            size = job.spec.usable_world_size(job.spec.scaling.max_workers)
            self.add_nodes(job.id, shape, size, per_node=1)
        self.run_pass()
        with self.srv.session() as s:
            left = [j.id for j in observe.pending_jobs(s)]
        if left:
            raise RuntimeError(f"queued jobs {left} could not be admitted before seeding")

    @contextmanager
    def run(self, *, live: bool = False) -> Iterator[_Run]:
        """One seeding. `live`: it happens now (real timestamps, nothing moved afterwards)."""
        self._settle()
        run = _Run(self, live=live)
        yield run
        run.finish()


_SIMS: dict[str, _Sim] = {}


def _sim(srv: ServerHandle) -> _Sim:
    sim = _SIMS.get(srv.database_url)
    if sim is None:
        sim = _SIMS[srv.database_url] = _Sim(srv)
    return sim


# ---------------------------------------------------------------------------------------
# One seeding: simulated time, and the timestamps moved to it afterwards
# ---------------------------------------------------------------------------------------


_WORKER_LOG = logging.Formatter("%(asctime)s [rank 0] %(levelname)s %(name)s: %(message)s")


class _Run:
    def __init__(self, sim: _Sim, *, live: bool) -> None:
        self.sim = sim
        self.live = live
        self.t = 0.0
        """Simulated seconds since the run began (unused when live)."""
        self.jobs: set[int] = set()
        self.anchors: list[tuple[float, float]] = []
        """(real epoch seconds, simulated seconds) at each pass."""
        self.step_t: dict[tuple[int, int], float] = {}
        self.commit_t: dict[tuple[int, int, int], float] = {}
        self.logs: dict[tuple[int, int], list[tuple[float, str]]] = {}

    def now(self) -> float:
        return time.time() if self.live else self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def mark(self) -> None:
        if not self.live:
            self.anchors.append((time.time(), self.t))

    def log(self, job_id: int, attempt: int, message: str) -> None:
        """An INFO line of rank 0's log, from `elastrain.workers.loop`."""
        self.logs.setdefault((job_id, attempt), []).append((self.now(), message))

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, body: dict[str, Any], *, workers: int, per_node: int = 1) -> _Play:
        """Submit over REST, give the job nodes for `workers` workers, and let the
        scheduler admit it (at `workers`: nothing more fits)."""
        play = self.submit_queued(body)
        play.add_nodes(workers, per_node=per_node)
        self.advance(QUEUE_S)
        self.sim.run_pass(self)
        job = play.job()
        if (job.state, job.world_size) != (JobState.STARTING, workers):
            raise RuntimeError(f"job {play.job_id} not admitted at {workers}: {job.state_reason}")
        play.follow(job)
        return play

    def submit_queued(self, body: dict[str, Any]) -> _Play:
        self.mark()
        job = self.sim.srv.submit(body)
        play = _Play(self.sim, int(job["id"]), JobSpec.model_validate(job["spec"]))
        self.sim.plays[play.job_id] = play
        self.jobs.add(play.job_id)
        return play.bind(self)

    def play(self, job_id: int) -> _Play:
        return self.sim.plays[job_id].bind(self)

    # -- afterwards -------------------------------------------------------------------------
    def finish(self) -> None:
        offset = 0.0 if self.live else time.time() - END_MARGIN_S - self.t
        if not self.live and self.jobs:
            self._move_timestamps(offset)
        self._write_logs(offset)

    def _move_timestamps(self, offset: float) -> None:
        reals = [r for r, _ in self.anchors]
        sims = [s for _, s in self.anchors]

        def moved(ts: datetime) -> datetime:
            i = bisect.bisect_right(reals, ts.timestamp()) - 1
            if i < 0:
                return ts
            # Within a pass, rows keep their order (and a pass never runs into the next).
            room = (sims[i + 1] - sims[i]) / 2 if i + 1 < len(sims) else 0.25
            t = sims[i] + min(ts.timestamp() - reals[i], room)
            return _at(offset + t)

        def moved_opt(ts: datetime | None) -> datetime | None:
            return None if ts is None else moved(ts)

        ids = list(self.jobs)
        storage = self.sim.settings.storage_path
        with self.sim.srv.session() as s:
            for job in s.scalars(select(Job).where(Job.id.in_(ids))):
                job.created_at = moved(job.created_at)
                job.updated_at = moved(job.updated_at)
                job.started_at = moved_opt(job.started_at)
                job.finished_at = moved_opt(job.finished_at)
                job.below_min_since = moved_opt(job.below_min_since)
            transitions: dict[int, list[Event]] = {}
            for ev in s.scalars(select(Event).where(Event.job_id.in_(ids))):
                ev.at = moved(ev.at)
                _shift_timeline(ev, offset)  # its marks were taken in simulated seconds
                if ev.kind == EventKind.TRANSITION:
                    transitions.setdefault(ev.job_id, []).append(ev)
            for job in s.scalars(select(Job).where(Job.id.in_(ids))):
                _recount_state_seconds(job, transitions.get(job.id, []))
            for att in s.scalars(select(Attempt).where(Attempt.job_id.in_(ids))):
                att.started_at = moved(att.started_at)
                att.ended_at = moved_opt(att.ended_at)
            for m in s.scalars(select(Metric).where(Metric.job_id.in_(ids))):
                t = self.step_t.get((m.job_id, m.step))
                m.at = _at(offset + t) if t is not None else moved(m.at)
            for c in s.scalars(select(CheckpointRecord).where(CheckpointRecord.job_id.in_(ids))):
                t = self.commit_t.get((c.job_id, c.step, c.attempt))
                c.committed_at = _at(offset + t) if t is not None else moved(c.committed_at)
                created = c.committed_at.timestamp()
                if c.manifest is not None:
                    c.manifest = {**c.manifest, "created_at": created}
                folder = step_dir(JobStorage.of(storage, c.job_id).checkpoints, c.step, c.attempt)
                if (folder / "manifest.json").is_file():
                    manifest = read_manifest(folder)
                    manifest.created_at = created
                    write_manifest(folder, manifest)

    def _write_logs(self, offset: float) -> None:
        storage = self.sim.settings.storage_path
        for (job_id, attempt), entries in self.logs.items():
            path = JobStorage.of(storage, job_id).log_file(attempt=attempt, rank=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = []
            for t, message in entries:
                record = logging.LogRecord(
                    "elastrain.workers.loop", logging.INFO, __file__, 0, message, None, None
                )
                record.created = offset + t
                record.msecs = (record.created % 1) * 1000
                lines.append(_WORKER_LOG.format(record) + "\n")
            with path.open("a") as fh:
                fh.write("".join(lines))


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


def _recount_state_seconds(job: Job, transitions: list[Event]) -> None:
    """The job's seconds in each state (goodput: queued, starting, recovering...) from its
    moved transitions. `set_job_state` added them up on the real clock, on which a seeding
    takes a fraction of a second; the story's own times are the simulated ones."""
    seconds: dict[str, float] = {}
    since = job.created_at
    for ev in sorted(transitions, key=lambda e: (e.at, e.id)):
        if ev.from_state is None:  # the submission
            continue
        spent = max(0.0, (ev.at - since).total_seconds())
        seconds[ev.from_state] = round(seconds.get(ev.from_state, 0.0) + spent, 3)
        since = ev.at
    job.seconds_in = seconds
    job.state_since = since


def _shift_timeline(ev: Event, seconds: float) -> None:
    """Move the phase times (epoch seconds) of a timeline event by `seconds`."""
    if ev.kind == EventKind.TIMELINE and ev.details:
        phases = [{**p, "at": p["at"] + seconds} for p in ev.details["phases"]]
        ev.details = {**ev.details, "phases": phases}


# ---------------------------------------------------------------------------------------
# One job: the driver's and workers' side of its attempts
# ---------------------------------------------------------------------------------------


class _Play:
    def __init__(self, sim: _Sim, job_id: int, job_spec: JobSpec) -> None:
        self.sim = sim
        self.job_id = job_id
        self.spec = job_spec
        self.shape = WorkerShape.of(job_spec)
        self.storage = JobStorage.of(sim.settings.storage_path, job_id)
        self.attempt = 0
        self.world_size = 0
        self.step = 0
        """The last step the current attempt's workers completed."""
        self.first_step = 1
        self.nodes: list[str] = []
        """The node of each rank of the current attempt, once placed."""
        self._held: list[str] = []
        """The nodes of the previous attempt's ranks (processes holding the job's state)."""
        self._marks: list[TimelineMark] = []
        """The current attempt's timeline so far (sent with its first step)."""
        self._run: _Run | None = None
        self._last_pass = 0.0
        self._stalled = 0.0
        """Seconds the last checkpoint save blocked training (reported with the next step)."""

    def bind(self, run: _Run) -> _Play:
        self._run = run
        return self

    @property
    def run(self) -> _Run:
        assert self._run is not None
        return self._run

    @property
    def driver(self) -> FakeDriver:
        return self.sim.launcher.driver(self.job_id, self.attempt)

    def job(self) -> Job:
        with self.sim.srv.session() as s:
            return get_job(s, self.job_id)

    def follow(self, job: Job) -> None:
        """Take up the job's newest attempt once the scheduler has launched one."""
        if job.attempt != self.attempt and (job.id, job.attempt) in self.sim.launcher.drivers:
            self.attempt = job.attempt
            self.world_size = self.driver.request.world_size
            self.step = 0
            self._held, self.nodes = self.nodes, []
            self._marks = []
            self._stalled = 0.0  # a new attempt's processes report their own saves
            self._mark(Phase.DETECTED, detail=self.driver.request.cause)

    def _pass(self) -> Job:
        self.sim.run_pass(self.run)
        self._last_pass = self.run.now()
        job = self.job()
        self.follow(job)
        return job

    # -- the cluster --------------------------------------------------------------------
    def add_nodes(self, workers: int, *, per_node: int = 1) -> list[str]:
        return self.sim.add_nodes(self.job_id, self.shape, math.ceil(workers / per_node), per_node)

    def lose_node(self, node_id: str) -> Job:
        """The node dies: the scheduler stops the attempt and relaunches at what fits."""
        self.run.advance(0.6)
        self.sim.launcher.remove_node(node_id)
        job = self._pass()
        if job.state != JobState.RECOVERING:
            raise RuntimeError(f"job {self.job_id} after losing {node_id[:12]}: {job.state}")
        return job

    # -- the driver and rank 0 ----------------------------------------------------------
    def place(self) -> None:
        """The worker group is up: it reports its placement and, if the job has a good
        checkpoint, resumes from it (as `elastrain.workers.resume.resume` does, from the disk)."""
        ranks: list[str] = []
        for node in self.sim.alive_nodes(self.job_id):
            fit = int(node.cpus // self.shape.cpus + 1e-9)
            if self.shape.gpus:
                fit = min(fit, int(node.gpus // self.shape.gpus + 1e-9))
            ranks += [node.node_id] * fit
        ranks = ranks[: self.world_size]
        if len(ranks) < self.world_size:
            raise RuntimeError(f"job {self.job_id}: {self.world_size} workers do not fit")
        driver = self.driver
        driver.placement = dict(enumerate(ranks))
        self.nodes = ranks
        dp, pp = self._layout()
        training = self.spec.training
        accum = max(1, training.global_batch_size // (dp * training.micro_batch_size))
        start = self.run.now()
        held = sum(min(ranks.count(n), self._held.count(n)) for n in set(ranks))
        for phase, after in LAUNCH_PHASES:
            detail = ""
            if phase == Phase.PLACED:
                detail = f"{len(ranks)} processes: {held} warm, {held} holding the job's state"
            self._mark(phase, at=start + after, detail=detail)
        self.run.advance(LAUNCH_S)
        self._log(
            f"job {self.job_id} attempt {self.attempt}: {self.spec.strategy.kind.value} "
            f"world_size={self.world_size} dp={dp} pp={pp} G={training.global_batch_size} "
            f"micro={training.micro_batch_size} accum={accum} steps={training.max_steps}"
        )
        info, _skipped = find_latest_good(self.storage.checkpoints)
        self.step = 0
        if info is not None:
            driver.resume(info.step, path=str(info.path), saved_world_size=info.world_size)
            self.step = info.step
            self._log(f"resumed from {info.path} at step {info.step}")
        restored = f"checkpoint step {info.step}" if info is not None else "fresh start"
        source = RestoreSource.CHECKPOINT if info is not None else None
        self._mark(Phase.STATE_RESTORED, detail=restored, source=source)
        self.first_step = self.step + 1
        self._pass()
        self.run.advance(FIRST_STEP_S)

    def train(self, last: int) -> Job:
        """Train up to step `last`, reporting as the driver would; the scheduler passes
        about every `PASS_INTERVAL_S` (and after the attempt's first step)."""
        self.driver.status = DriverStatus.RUNNING
        job = None
        while self.step < last:
            self._do_step()
            due = self.run.now() - self._last_pass >= PASS_INTERVAL_S
            if due or self.step == self.first_step or self.step == last:
                job = self._pass()
        return job if job is not None else self.job()

    def stop_for_resize(self) -> Job:
        """The stop asked by the scheduler arrives: one more step, a checkpoint, STOPPED."""
        if not self.driver.stop_requested:
            raise RuntimeError(f"job {self.job_id}: no stop was requested")
        self._do_step(reason="stop")
        self._log(f"stopped at step {self.step}")
        self.driver.status = DriverStatus.STOPPED
        self.run.advance(1.5)
        return self._pass()

    def finish(self) -> Job:
        """max_steps reached (its checkpoint is committed): the driver reports SUCCEEDED."""
        if self.step != self.spec.training.max_steps:
            self.train(self.spec.training.max_steps)
        self._log(f"finished at step {self.step}")
        self.driver.status = DriverStatus.SUCCEEDED
        self.run.advance(1.0)
        job = self._pass()
        if job.state != JobState.SUCCEEDED:
            raise RuntimeError(f"job {self.job_id} did not succeed: {job.state}")
        return job

    def fail(self, error: WorkerError) -> Job:
        """A rank raised: the driver forwards the error and reports FAILED."""
        driver = self.driver
        driver.events.append(
            {"kind": "worker_error", "reason": error.summary(), "details": error.to_dict()}
        )
        driver.error = error
        driver.status = DriverStatus.FAILED
        self.run.advance(1.0)
        return self._pass()

    def cancel(self) -> Job:
        """The user cancels over REST; the scheduler stops the driver on its next pass."""
        with self.sim.srv.http() as client:
            client.post(f"/v1/jobs/{self.job_id}/cancel").raise_for_status()
        self.run.advance(0.5)
        return self._pass()

    # -- pieces -------------------------------------------------------------------------
    def _layout(self) -> tuple[int, int]:
        if self.spec.strategy.kind == StrategyKind.pipeline:
            pp = self.spec.strategy.stages
            return max(1, self.world_size // pp), pp
        return self.world_size, 1

    def _log(self, message: str) -> None:
        self.run.log(self.job_id, self.attempt, message)

    def _mark(
        self,
        phase: Phase,
        *,
        at: float | None = None,
        detail: str = "",
        source: RestoreSource | None = None,
    ) -> None:
        """A phase of the attempt's start reached (at the run's time: simulated seconds,
        moved with the other timestamps afterwards)."""
        at = self.run.now() if at is None else at
        self._marks.append(TimelineMark(phase=phase, at=at, detail=detail, source=source))

    def _send_timeline(self) -> None:
        """The first step is done: the driver sends the attempt's timeline, right after
        rank 0's point of that step (as `elastrain.workers.runtime.driver` orders them)."""
        driver = self.driver
        self._mark(Phase.FIRST_STEP)
        for point in driver.metrics:
            driver._send(StepMetrics.from_point(point))
        driver.metrics = []
        driver._send(Timeline(cause=driver.request.cause, marks=tuple(self._marks)))

    def _do_step(self, *, reason: str = "scheduled") -> None:
        step = self.step + 1
        training = self.spec.training
        ws = self.world_size
        dt = _step_time(ws, step)
        self.run.advance(dt)
        self.run.step_t[(self.job_id, step)] = self.run.now()
        loss = loss_at(step, seed=self.job_id)
        lr = training.learning_rate * 0.5 * (1 + math.cos(math.pi * step / training.max_steps))
        tokens = self.spec.workload.name == "gpt"
        self.driver.metrics.append(
            {
                "step": step,
                "loss": loss,
                "lr": lr,
                "step_time_s": dt,
                "samples_per_s": round(training.global_batch_size / dt, 2),
                "tokens_per_s": round(training.global_batch_size * SEQ_LEN / dt, 1)
                if tokens
                else None,
                "world_size": ws,
                "checkpoint_stall_s": self._stalled,
            }
        )
        self._stalled = 0.0
        self.step = step
        if step == self.first_step:
            self._send_timeline()
        if step % LOG_EVERY_STEPS == 0 or step == self.first_step:
            self._log(f"step {step} loss {loss:.4f} ({dt:.3f}s)")
        every = self.spec.checkpoint.every_steps
        if step % every == 0 or step == training.max_steps or reason != "scheduled":
            self._commit(reason)

    def _commit(self, reason: str) -> None:
        """Every rank writes its shard, rank 0 the manifest last; rank 0 sends the commit."""
        step, ws = self.step, self.world_size
        dp, pp = self._layout()
        training = self.spec.training
        size = ws * 3_400_000 + step * 17
        blocked = 0.012 + 0.002 * ws
        self._log(f"checkpoint at step {step} ({reason}): blocked {blocked:.3f}s")
        self.run.advance(0.3)
        folder = step_dir(self.storage.checkpoints, step, self.attempt)
        folder.mkdir(parents=True, exist_ok=True)
        # Stand-ins for the DCP files (a shard per rank, the metadata), so that the
        # manifest verifies when a later attempt looks for the checkpoint to resume from.
        for rank in range(ws):
            (folder / f"__{rank}_0.distcp").write_text(f"e2e shard of rank {rank}, step {step}\n")
        (folder / DCP_METADATA_NAME).write_text(f"e2e metadata, step {step}\n")
        manifest = Manifest(
            step=step,
            attempt=self.attempt,
            world_size=ws,
            strategy=self.spec.strategy.kind.value,
            layout={"dp": dp, "pp": pp},
            data_position={"step": step, "samples_consumed": step * training.global_batch_size},
            extra={
                "seed": training.seed,
                "global_batch_size": training.global_batch_size,
                "micro_batch_size": training.micro_batch_size,
            },
            files=describe_files(folder),
            total_bytes=size,
            created_at=self.run.now(),  # moved with the other timestamps afterwards
        )
        write_manifest(folder, manifest)
        self.driver.commits.append(
            {
                "step": step,
                "world_size": ws,
                "path": str(folder),
                "bytes": size,
                "manifest": manifest.to_dict(),
            }
        )
        self.run.commit_t[(self.job_id, step, self.attempt)] = self.run.now()
        self._stalled = blocked  # as elastrain.workers.loop reports it: with the next step's point
        self._log(f"checkpoint committed: {folder}")


# ---------------------------------------------------------------------------------------
# What tests and screenshots use
# ---------------------------------------------------------------------------------------


def elastic_job(
    srv: ServerHandle,
    *,
    name: str = "gpt-tiny-elastic",
    max_steps: int = 300,
    stop_at: int | None = 262,
    labels: dict[str, str] | None = None,
    strategy: str = "ddp",
) -> Story:
    """A job at 4 workers on 2 nodes of 2 CPUs. The node holding ranks 2 and 3 dies after
    step 137: the scheduler stops the attempt and relaunches it at 2 on the node left,
    which resumes from the latest checkpoint (step 125). A node joins again around step
    200; once the scheduler has seen the capacity for `grow_interval_s` it asks the attempt
    to checkpoint and stop (step 210) and relaunches at 4. It finishes SUCCEEDED when
    `stop_at` is None, else it is left RUNNING at `stop_at`."""
    body = spec(
        name,
        scaling={"min_workers": 2, "max_workers": 4},
        training={"max_steps": max_steps},
        labels=labels or {"team": "nlp", "size": "tiny"},
        strategy={"kind": strategy},
    )
    end = max_steps if stop_at is None else min(stop_at, max_steps)
    sim = _sim(srv)
    lost_node = None
    with sim.run() as run:
        play = run.submit(body, workers=4, per_node=2)
        play.place()
        lost_at = min(LOST_AT, end)
        play.train(lost_at)
        if end > lost_at:
            lost_node = play.nodes[2]
            play.lose_node(lost_node)  # -> RECOVERING, relaunched at 2
            play.place()
            grow_at = min(GROW_AT, end)
            if end > grow_at:
                play.train(grow_at - 10)
                play.add_nodes(2, per_node=2)  # a node joins: spare capacity from now on
                play.train(grow_at - 2)
                sim.clock.advance(GROW_INTERVAL_S)
                job = play.train(grow_at - 1)
                if job.state != JobState.RESIZING:
                    raise RuntimeError(f"job {play.job_id} did not grow: {job.state_reason}")
                play.stop_for_resize()  # -> relaunched at 4
                play.place()
        play.train(end)
        if stop_at is None:
            play.finish()
    with srv.session() as s:
        job = get_job(s, play.job_id)
        return Story(
            job_id=play.job_id,
            metric_steps=sorted(s.scalars(select(Metric.step).where(Metric.job_id == job.id))),
            last_loss=job.latest_loss,
            checkpoint_steps=sorted(
                s.scalars(select(CheckpointRecord.step).where(CheckpointRecord.job_id == job.id))
            ),
            lost_node=lost_node,
        )


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
    """A RUNNING job at `world_size` (one node per worker) that has trained `step` steps,
    with the checkpoints its spec makes (every 25 steps). `step=0`: left STARTING.
    `spec_overrides` replace whole sections of the spec."""
    body = spec(name, training={"max_steps": max_steps}, labels=labels or {"team": "nlp"})
    body.update(spec_overrides)
    with _sim(srv).run() as run:
        return _running(run, body, step=step, world_size=world_size).job_id


def _running(run: _Run, body: dict[str, Any], *, step: int, world_size: int) -> _Play:
    play = run.submit(body, workers=world_size)
    play.place()
    if step:
        play.train(step)
    return play


def prepare_job(srv: ServerHandle, points: list[dict[str, Any]]) -> int:
    """A RUNNING `elastrain prepare` job (its tokenizer and input written to the server's
    storage, as a tenant would) that has reported `points` (`workers.prepare.Progress`)."""
    from tests.unit.test_prepare import DOCS, write_tokenizer

    area = srv.storage_path / "data" / "default"
    write_tokenizer(area / "tok", DOCS)
    (area / "in").mkdir(parents=True, exist_ok=True)
    (area / "in" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    body = {
        "name": "prepare-corpus",
        "workload": {"name": "prepare",
                     "params": {"inputs": ["in/*.jsonl"], "tokenizer": "tok", "out": "prep"}},
        "scaling": {"min_workers": 1, "max_workers": 1},
    }  # fmt: skip
    with _sim(srv).run() as run:
        play = _running(run, body, step=0, world_size=1)
        play.driver.status = DriverStatus.RUNNING
        for point in points:
            run.advance(1.0)
            play.driver.metrics.append(point)
        play._pass()
        return play.job_id


def train(srv: ServerHandle, job_id: int, to_step: int) -> None:
    """Now: the job's current attempt trains on to `to_step` (the scheduler persists it)."""
    with _sim(srv).run(live=True) as run:
        run.play(job_id).train(to_step)


def fail(srv: ServerHandle, job_id: int, error: str | WorkerError) -> JobState:
    """Now: a rank of the job's current attempt raises `error`. The scheduler decides what
    follows (FAILED when restarts are used up, e.g. with `failure.max_restarts: 0`)."""
    if isinstance(error, str):
        error = WorkerError(type="RuntimeError", message=error)
    with _sim(srv).run(live=True) as run:
        return JobState(run.play(job_id).fail(error).state)


def scheduler_pass(srv: ServerHandle) -> None:
    """Now: the scheduler acts on what changed (a cancel, a checkpoint request...)."""
    sim = _sim(srv)
    with sim.run(live=True) as run:
        sim.run_pass(run)


def backdate(srv: ServerHandle, job_id: int, seconds: float) -> None:
    """Move a job's history `seconds` into the past (its age in the list)."""
    delta = timedelta(seconds=seconds)
    with srv.session() as s:
        job = get_job(s, job_id)
        for attr in (
            "created_at", "updated_at", "started_at", "finished_at", "below_min_since",
            "state_since",
        ):  # fmt: skip
            if getattr(job, attr) is not None:
                setattr(job, attr, getattr(job, attr) - delta)
        for ev in s.scalars(select(Event).where(Event.job_id == job_id)):
            ev.at = ev.at - delta
            _shift_timeline(ev, -seconds)
        for att in s.scalars(select(Attempt).where(Attempt.job_id == job_id)):
            att.started_at = att.started_at - delta
            if att.ended_at is not None:
                att.ended_at = att.ended_at - delta
        for m in s.scalars(select(Metric).where(Metric.job_id == job_id)):
            m.at = m.at - delta
        for c in s.scalars(select(CheckpointRecord).where(CheckpointRecord.job_id == job_id)):
            c.committed_at = c.committed_at - delta


def showcase(srv: ServerHandle) -> Story:
    """A varied list for screenshots: every state, three strategies, one elastic story."""
    done = elastic_job(srv, name="gpt-small-fsdp", stop_at=None, strategy="fsdp",
                       labels={"team": "nlp", "size": "small"})  # fmt: skip
    backdate(srv, done.job_id, 3 * 3600)

    sim = _sim(srv)
    # Diverges at a high learning rate: the same error at the same step three times in a
    # row, so the scheduler gives up after two restarts.
    with sim.run() as run:
        body = spec("vision-sweep-lr1e-2", training={"max_steps": 400, "learning_rate": 1e-2},
                    labels={"team": "vision", "sweep": "lr"})  # fmt: skip
        sweep = _running(run, body, step=57, world_size=2)
        while True:
            error = WorkerError(
                type="FloatingPointError",
                message="non-finite loss (nan) with learning_rate 0.01",
                rank=1,
                node_id=sweep.nodes[1],
                step=57,
                traceback="Traceback (most recent call last):\n  ...\n"
                "FloatingPointError: non-finite loss (nan) with learning_rate 0.01",
            )
            if sweep.fail(error).state == JobState.FAILED:
                break
            sweep.place()
            sweep.train(57)
    backdate(srv, sweep.job_id, 2 * 3600)

    with sim.run() as run:
        body = spec("gpt-tiny-debug", training={"max_steps": 200})
        cancelled = _running(run, body, step=12, world_size=2)
        cancelled.cancel()
    backdate(srv, cancelled.job_id, 5400)

    with sim.run() as run:
        body = spec("synthetic-smoke", workload={"name": "synthetic"},
                    training={"max_steps": 50}, labels={"team": "infra"})  # fmt: skip
        smoke = _running(run, body, step=50, world_size=2)
        smoke.finish()
    backdate(srv, smoke.job_id, 3000)

    pipe = running_job(srv, name="gpt-pipeline-1f1b", step=180, max_steps=1000, world_size=4,
                       strategy={"kind": "pipeline", "pipeline_stages": 2, "schedule": "1f1b"},
                       labels={"team": "nlp", "size": "small"})  # fmt: skip
    backdate(srv, pipe, 1500)

    story = elastic_job(srv)  # RUNNING, lost a node, grew back

    # Loses the node of rank 1 and is left RECOVERING: relaunched at 1, not yet up.
    with sim.run() as run:
        body = spec("vision-resnet-ddp", training={"max_steps": 500}, labels={"team": "vision"})
        rec = _running(run, body, step=96, world_size=2)
        rec.lose_node(rec.nodes[1])
    backdate(srv, rec.job_id, 240)

    # Queued: every node is taken, and these need 4 free workers each.
    with sim.run() as run:
        for name, team in (("gpt-medium-fsdp", "nlp"), ("vision-vit-sweep-3", "vision")):
            run.submit_queued(spec(name, strategy={"kind": "fsdp"}, labels={"team": team},
                                   scaling={"min_workers": 4, "max_workers": 8}))  # fmt: skip
        sim.run_pass(run)
    return story


def million_step_job(srv: ServerHandle, *, steps: int = 1_000_000) -> int:
    """A RUNNING job with `steps` metric rows, written in bulk (a year of a long job is
    what the metrics path must survive, not what the scheduler can replay in a test),
    with the bucket summaries the scheduler would have kept."""
    from elastrain.service.jobs import create_job, set_job_state, start_attempt
    from elastrain.service.metric_store import insert_bulk

    def values(step: int) -> dict[str, Any]:
        point: dict[str, Any] = {
            "loss": 4.0 * math.exp(-step / 200_000) + 0.05 * math.sin(step / 500),
            "step_time_s": 0.1 + 0.01 * math.sin(step / 77),
            "tokens_per_s": 20_000.0,
        }
        if step % 10_000 == 0:
            point["eval_loss"] = point["loss"] + 0.2
        return point

    body = spec("a-million-steps", training={"max_steps": steps * 2})
    with srv.session() as s:
        job = create_job(s, spec=JobSpec.model_validate(body))
        start_attempt(s, job, world_size=4, driver_name=f"driver-{job.id}-1")
        set_job_state(s, job, JobState.STARTING, reason="admitted", world_size=4)
        set_job_state(s, job, JobState.RUNNING, reason="first step", world_size=4)
        job_id = job.id
    at = datetime.now(timezone.utc)
    chunk = 50_000
    for start in range(1, steps + 1, chunk):
        points = [(i, values(i)) for i in range(start, min(start + chunk, steps + 1))]
        with srv.session() as s:
            insert_bulk(s, job_id, points, attempt=1, at=at)
    with srv.session() as s:
        job = get_job(s, job_id)
        job.step = steps
        job.latest_loss = values(steps)["loss"]
    return job_id
