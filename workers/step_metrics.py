"""Each optimizer step's metric point: loss, learning rate, step time and what blocked it,
throughput, model FLOPs and MFU, the layout, memory, the batch's checksum.

Memory figures (parameter/gradient/optimizer bytes, activation peak, RSS) are measured on
an attempt's first step and then at most every `MEMORY_EVERY_S`; the steps between carry
the latest figures. Measuring walks every parameter and optimizer state and hooks every
tensor autograd saves, a cost worth paying every few seconds, not every step, for figures
that do not change from step to step (docs/benchmarks.md, part 1).
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from elastrain.contracts.messages import StepMetrics
from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import Workload
from elastrain.workers.flops import device_peak, mfu
from elastrain.workers.strategies import Strategy

MEMORY_EVERY_S = 2.0


class StepMeter:
    """Makes the points of one attempt's steps (every rank makes the same but memory)."""

    def __init__(
        self, strategy: Strategy, workload: Workload, spec: JobSpec, *, world_size: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.strategy = strategy
        self.tokens_per_sample = workload.tokens_per_sample
        self.flops_per_sample = workload.flops_per_sample
        self.global_batch = spec.training.global_batch_size
        self.world_size = world_size
        mixed = spec.strategy.mixed_precision
        self.peak = device_peak(device, mixed.value if mixed is not None else None)
        self.memory = MemoryMeter(strategy)
        self._first = True

    def start_step(self) -> None:
        self.memory.start_step()

    def point(
        self,
        done: int,
        loss: float,
        step_time: float,
        crc: int,
        *,
        checkpoint_stall_s: float,
        eval_loss: float | None = None,
    ) -> StepMetrics:
        """The point of optimizer step `done` (1-based), just finished."""
        point = step_metrics(
            done, loss, step_time, self.strategy, self.tokens_per_sample, self.global_batch,
            self.world_size, crc, checkpoint_stall_s=checkpoint_stall_s,
            flops_per_sample=self.flops_per_sample, peak=self.peak,
            first_of_attempt=self._first, memory=self.memory.read(),
        )  # fmt: skip
        self._first = False
        return point if eval_loss is None else replace(point, eval_loss=eval_loss)


def step_metrics(
    done: int,
    loss: float,
    step_time: float,
    strategy: Strategy,
    tokens_per_sample: int | None,
    global_batch: int,
    world_size: int,
    crc: int,
    *,
    checkpoint_stall_s: float = 0.0,
    flops_per_sample: float | None = None,
    peak: tuple[float | None, str] = (None, ""),
    first_of_attempt: bool = False,
    memory: dict[str, int] | None = None,
) -> StepMetrics:
    samples_per_s = global_batch / step_time
    layout = strategy.layout
    flops_per_s, utilisation = mfu(flops_per_sample, global_batch, step_time, world_size, peak[0])
    return StepMetrics(
        step=done,
        loss=loss,
        lr=strategy.optimizer.param_groups[0]["lr"],
        step_time_s=step_time,
        checkpoint_stall_s=checkpoint_stall_s,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens_per_sample if tokens_per_sample else None,
        model_flops_per_s=flops_per_s,
        mfu=utilisation,
        world_size=world_size,
        dp=layout.dp,
        pp=layout.pp,
        tp=layout.tp,
        memory=memory if memory is not None else measure_memory(strategy),
        batch_crc=crc,
        # Once per attempt: where the peak comes from, or why there is no MFU.
        mfu_basis=(
            (peak[1] if flops_per_sample else "the workload gives no flops_per_sample")
            if first_of_attempt
            else None
        ),
    )


class MemoryMeter:
    """Measures a rank's memory on the first step and then every `MEMORY_EVERY_S`, arming
    the activation meter only for the steps it measures (its hooks cost every saved
    tensor a call). Each rank decides alone: the figures are per rank, no peer waits."""

    def __init__(
        self,
        strategy: Strategy,
        every_s: float = MEMORY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.strategy = strategy
        self.every_s = every_s
        self.clock = clock
        self._measured_at = -math.inf
        self._latest: dict[str, int] | None = None
        self._due = True

    def start_step(self) -> None:
        self._due = self.clock() - self._measured_at >= self.every_s
        self.strategy.activations.armed = self._due

    def read(self) -> dict[str, int]:
        """This step's figures if it was measured, else the latest (the same dict: never
        mutated once made)."""
        if self._due or self._latest is None:
            self._latest = measure_memory(self.strategy)
            self.strategy.activations.reset()  # the activation peak is per measured step
            self._measured_at = self.clock()
        return self._latest


def measure_memory(strategy: Strategy) -> dict[str, int]:
    return {**strategy.memory_bytes(), "rss_bytes": rss_bytes()}


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak (getrusage, KiB)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
