"""Parallelism strategies (ddp, fsdp, pipeline, tp; fsdp and pipeline compose with tp). `make_strategy(kind)` builds one from the spec's `strategy.kind`."""

from __future__ import annotations

from elastrain.contracts.spec import StrategyKind
from elastrain.workers.strategies.base import Layout, MicroBatch, StepResult, Strategy

__all__ = ["Layout", "MicroBatch", "StepResult", "Strategy", "make_strategy"]


def make_strategy(kind: StrategyKind) -> Strategy:
    """A fresh, not yet set-up strategy for this rank. Modules are imported lazily so a
    ddp job never imports the pipelining machinery (and vice versa)."""
    kind = StrategyKind(kind)  # also accepts the plain value ("ddp"), and names a bad one
    if kind is StrategyKind.ddp:
        from elastrain.workers.strategies.ddp import DDPStrategy

        return DDPStrategy()
    if kind is StrategyKind.fsdp:
        from elastrain.workers.strategies.fsdp import FSDPStrategy

        return FSDPStrategy()
    if kind is StrategyKind.pipeline:
        from elastrain.workers.strategies.pipeline import PipelineStrategy

        return PipelineStrategy()
    if kind is StrategyKind.tp:
        from elastrain.workers.strategies.tensor_parallel import TensorParallelStrategy

        return TensorParallelStrategy()
    raise AssertionError(f"unhandled StrategyKind {kind!r}")  # pragma: no cover
