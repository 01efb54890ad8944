"""What the runtime (`elastrain.workers.runtime`) and a worker process (`elastrain.workers.process`)
say to each other: the worker processes outlive attempts, so each attempt hands every
rank an `Assignment`, and every rank answers with a `RunOutcome` when its part ends."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastrain.contracts.messages import WorkerError
from elastrain.contracts.runtime import JobRef
from elastrain.contracts.spec import JobSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldState:
    """The training state a worker process keeps in memory after an attempt ended."""

    job_id: int
    step: int
    """Optimizer steps applied to the state it holds."""
    world_size: int
    full_replica: bool
    """True when this one process holds the whole model and optimizer state (DDP), so a
    new group can take it from here instead of from a checkpoint."""
    database: str = ""
    """The database the job is stored in (`elastrain.contracts.runtime.JobRef`)."""

    @property
    def job(self) -> JobRef:
        return JobRef(self.database, self.job_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInfo:
    name: str
    node_id: str
    pid: int
    address: str
    busy: bool
    held: HeldState | None = None
    gpu: int | None = None
    """The node-local index of the GPU this process owns for its lifetime (None: a CPU
    process, which sees no GPU)."""
    device: str = ""
    """What it trains on, in words (`elastrain.workers.devices.warm_cuda`)."""
    own_code_of: JobRef | None = None
    """The job whose own code this process ran, if any (`elastrain.workers.runtime.pool.runs_own_code`):
    a runtime that adopts the process after a restart lends it to that job alone."""
    warm_at: float = 0.0
    """When its start's imports were done (its wall clock; 0: not known)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """One rank's part in one attempt."""

    job_id: int
    attempt: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    spec: JobSpec
    storage_path: str
    database: str
    """The database the job is stored in: a process keeps state only for this database's
    jobs (`elastrain.contracts.runtime.JobRef`)."""
    runtime_name: str
    """The runtime actor that rank 0 reports to (`push_many`); controls come the other way,
    pushed to rank 0's process (`control`)."""
    namespace: str
    collective_timeout_s: float
    local_rank: int = 0
    """This rank's index among the attempt's ranks on its node (ranks are numbered node by
    node); with the three below, what a command job's script gets as under torchrun."""
    local_world_size: int = 1
    group_rank: int = 0
    """Its node's index among the attempt's nodes."""
    group_world_size: int = 1
    local_gpus: tuple[int, ...] = ()
    """The node-local GPU indices of this node's ranks, by local rank (GPU jobs): a
    command job's script sees them all and picks `cuda:LOCAL_RANK`, as under torchrun."""
    run_as: str = ""
    """`LaunchRequest.run_as`: the OS identity a command script runs as ("" the worker's)."""
    capability: str = field(default="", repr=False)
    """The attempt's capability (`elastrain.contracts.capability`): rank 0 presents it with
    its reports. Kept in the rank process's memory, never handed to a job's script."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    rank: int
    final_step: int | None = None
    stopped_early: bool = False
    error: WorkerError | None = None
    aborted: bool = False
    """Told to let go (the attempt was released) before it ended by itself."""
    held: HeldState | None = None
    """What the process keeps in memory now that its part ended."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProgress:
    """How far a rank's training got, as its process answers the runtime's poll (the
    runtime's hang watch, `elastrain.workers.runtime.hangs`). Times are wall clock."""

    step: int
    """The last step this rank finished."""
    last_step_at: float
    """When it finished it (or when the attempt's loop started, before its first)."""
    steps_done: int
    """Steps finished in this attempt."""
    phase: str
    """What the rank is doing now: `data` (its batch), `step` (forward, backward, the
    gradient collectives and the update), `memory` (peer memory's refresh), `checkpoint`,
    `eval`, `start`."""
    phase_since: float
    median_step_s: float | None
    """The median of its recent steps' wall time (None before its first)."""
    where: str = ""
    """The innermost frames of its training thread's stack, `file:line in function`."""
    local: tuple[tuple[int, float], ...] = ()
    """(step, seconds) of its recent steps' local work: its batch and its update, the
    part of a step no peer paces (`elastrain.workers.local_work`)."""
