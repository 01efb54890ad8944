"""Contracts between the training loop, the strategies, the workloads and the Ray glue.

Nothing here imports Ray: the loop runs under any torch.distributed launcher (the
runtime's worker processes, `elastrain.workers.process`, torchrun, or `torch.multiprocessing` in the
tests) and talks to the outside world only through `TrainHooks`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from elastrain.contracts.messages import Control, StepMetrics, WorkerMessage
from elastrain.workers.progress import Progress

__all__ = [
    "Control",
    "TrainContext",
    "TrainHooks",
    "TrainResult",
    "Workload",
    "WorkloadFactory",
]

# ---------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------


class SampleDataset(Protocol):
    """What a workload's dataset must offer: a length and `(input, target)` by index (a
    list, or a map-style `torch.utils.data.Dataset` with `__len__`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(kw_only=True)
class Workload:
    """What a workload factory (`module:function`, called with the spec's params) returns.

    A workload that cannot run fails its job at once, with its own message and no restart
    counted (a configuration error: a retry would fail the same): whatever its module
    raises on import, its factory raises, its dataset raises for its length or first
    sample, and what the job's first training step raises (the first forward, loss and
    backward on real samples), but for out of memory, a device fault or a peer gone.
    After the first step an exception is retried as any failure is (`failure.max_restarts`).
    """

    model: nn.Module
    """The full model, built on CPU. Strategies move it to the device and wrap it.

    For `fsdp`, modules listed by `model.shard_units()` (if defined) are sharded one by one
    (e.g. transformer blocks) before the root. For `pipeline` the model must define
    `model.pipeline_stage(stage_index, num_stages) -> nn.Module`, returning the part of the
    model that stage runs, with parameter names (FQNs) unchanged so that checkpoints load
    whatever the split.
    """
    dataset: SampleDataset
    """Indexable samples `(input, target)`; sample ids are indices into it."""
    eval_dataset: SampleDataset | None = None
    """Held-out samples, never trained on (the gpt's `eval_path`, or the end of its
    `data_path`); `training.eval_every` evaluates on them."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """`loss_fn(output, target)` -> the MEAN loss over the micro-batch (PyTorch's default
    reduction). The loop turns it into a sum and normalises by the global batch size."""
    tokens_per_sample: int | None = None
    """For tokens/s; None reports samples/s only."""
    flops_per_sample: float | None = None
    """Forward+backward FLOPs per sample, for MFU on GPU; None if unknown."""


WorkloadFactory = Callable[..., Workload]


# ---------------------------------------------------------------------------------------
# The loop's surroundings (`Control` comes from `elastrain.contracts.messages`, re-exported here)
# ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainContext:
    """Where and what a rank is. Filled by the launcher glue (`elastrain.workers.process` or a test)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    job_id: int
    attempt: int
    checkpoint_root: Path
    """This job's checkpoint folder (shared storage): one sub-folder per checkpoint."""
    log_path: Path | None = None
    progress: Progress | None = None
    """Where the loop marks what it does and each step it finishes (the runtime's hang
    watch reads it through the process); None: nobody watches."""
    storage_root: Path | None = None
    """The storage root shared by every node: where the gpt's `data_path` is resolved."""
    step: int = 0
    """Optimizer steps completed so far (0 before training); the loop updates it each
    step, so the launcher glue can say at which step a failure happened."""
    abort: threading.Event | None = None
    """Set by the launcher glue when the attempt is released under the loop: every rank
    checks it between steps and raises `AttemptAborted` (no collective needed)."""
    node: str = ""
    """The node this rank runs on (Ray's node id; empty: this host's name). Peer memory
    keeps each rank's state also on a rank of another node (`elastrain.workers.memory.rules`)."""
    database: str = ""
    """The database the job is stored in: the job's folder must be fenced by it
    (`elastrain.checkpoints.fence.Fence.owner`), else another database's job of the same id owns it
    now and this rank writes nothing more."""


class AttemptAborted(Exception):
    """The attempt was released while this rank was still training."""


class TrainHooks(Protocol):
    """How the loop talks to the service. Called on rank 0 only; must not block."""

    def send(self, message: WorkerMessage) -> None:
        """Hand one typed message (`elastrain.contracts.messages`) to the driver."""
        ...

    def poll_control(self) -> Control:
        """What the service asks of the group now (Control.NONE when nothing)."""
        ...

    def undelivered(self) -> Sequence[StepMetrics]:
        """The metric points sent but not known to have reached the service, oldest
        first. The loop saves them with each checkpoint, so an attempt that resumes from
        it can hand back what never arrived (a partitioned node's zombie)."""
        ...


@dataclass(kw_only=True)
class TrainResult:
    """What the loop returns on rank 0."""

    final_step: int
    stopped_early: bool  # True when a Control.STOP ended it before max_steps
    resumed_from_step: int | None
