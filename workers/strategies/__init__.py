"""Parallelism strategies. `make_strategy(kind)` builds one from the spec's `strategy.kind`."""

from __future__ import annotations

from workers.strategies.base import Layout, StepOutput, Strategy

__all__ = ["STRATEGY_KINDS", "Layout", "StepOutput", "Strategy", "make_strategy"]

#: Must match `service.spec.StrategyKind`.
STRATEGY_KINDS = ("ddp", "fsdp", "pipeline")


def make_strategy(kind: str) -> Strategy:
    """A fresh, not yet set-up strategy for this rank. Modules are imported lazily so a
    ddp job never imports the pipelining machinery (and vice versa)."""
    if kind == "ddp":
        from workers.strategies.ddp import DDPStrategy

        return DDPStrategy()
    if kind == "fsdp":
        from workers.strategies.fsdp import FSDPStrategy

        return FSDPStrategy()
    if kind == "pipeline":
        from workers.strategies.pipeline import PipelineStrategy

        return PipelineStrategy()
    raise ValueError(f"strategy.kind: unknown {kind!r}; allowed: {', '.join(STRATEGY_KINDS)}")
