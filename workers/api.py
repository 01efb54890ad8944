"""Contracts between the training loop, the strategies, the workloads and the Ray glue.

Nothing here imports Ray: the loop runs under any torch.distributed launcher (Ray Train,
torchrun, or `torch.multiprocessing` in the tests) and talks to the outside world only
through `TrainHooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

# ---------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Workload:
    """What a workload factory (`module:function`, called with the spec's params) returns."""

    model: nn.Module
    """The full model, built on CPU. Strategies move it to the device and wrap it.

    For `fsdp`, modules listed by `model.shard_units()` (if defined) are sharded one by one
    (e.g. transformer blocks) before the root. For `pipeline` the model must define
    `model.pipeline_stage(stage_index, num_stages) -> nn.Module`, returning the part of the
    model that stage runs, with parameter names (FQNs) unchanged so that checkpoints load
    whatever the split.
    """
    dataset: Sequence[tuple[torch.Tensor, torch.Tensor]]
    """Indexable samples `(input, target)`; sample ids are indices into this sequence."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """`loss_fn(output, target)` -> the MEAN loss over the micro-batch (PyTorch's default
    reduction). The loop turns it into a sum and normalises by the global batch size."""
    tokens_per_sample: int | None = None
    """For tokens/s; None reports samples/s only."""
    flops_per_sample: float | None = None
    """Forward+backward FLOPs per sample, for MFU on GPU; None if unknown."""


WorkloadFactory = Callable[..., Workload]


# ---------------------------------------------------------------------------------------
# Control between the service and the loop
# ---------------------------------------------------------------------------------------


class Control(str, Enum):
    """What the service asks of a running worker group, checked once per step by rank 0
    and broadcast to all ranks so every rank acts at the same step."""

    NONE = "none"
    CHECKPOINT = "checkpoint"  # save a checkpoint after this step, keep going
    STOP = "stop"  # save a checkpoint after this step, then return (resize / preempt)


@dataclass(kw_only=True)
class TrainContext:
    """Where and what a rank is. Filled by the launcher glue (Ray Train or a test)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    job_id: int
    attempt: int
    checkpoint_root: Path
    """This job's checkpoint folder (shared storage): one sub-folder per checkpoint."""
    log_path: Path | None = None


class TrainHooks(Protocol):
    """How the loop talks to the service. Called on rank 0 only; must not block."""

    def report_metrics(self, point: dict[str, Any]) -> None: ...

    def checkpoint_committed(self, info: dict[str, Any]) -> None: ...

    def event(self, kind: str, reason: str, details: dict[str, Any] | None = None) -> None: ...

    def poll_control(self) -> Control: ...


@dataclass
class NullHooks:
    """Hooks that record what the loop reports (tests, standalone runs)."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, dict[str, Any] | None]] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)

    def report_metrics(self, point: dict[str, Any]) -> None:
        self.metrics.append(point)

    def checkpoint_committed(self, info: dict[str, Any]) -> None:
        self.commits.append(info)

    def event(self, kind: str, reason: str, details: dict[str, Any] | None = None) -> None:
        self.events.append((kind, reason, details))

    def poll_control(self) -> Control:
        return self.controls.pop(0) if self.controls else Control.NONE


@dataclass(kw_only=True)
class TrainResult:
    """What the loop returns on rank 0."""

    final_step: int
    stopped_early: bool  # True when a Control.STOP ended it before max_steps
    resumed_from_step: int | None
