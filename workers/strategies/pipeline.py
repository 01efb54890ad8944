"""Pipeline parallelism with `torch.distributed.pipelining` (GPipe or 1F1B), optionally
data-parallel across whole pipeline replicas.

Layout. With `S` stages, tensor-parallel degree `T` (`strategy.tensor_parallel`, 1 unless
set) and world size `W` (a multiple of `S*T`; the scheduler only launches pipeline jobs at
such sizes), there are `dp = W // (S*T)` replicas and the mapping is replica-major with
tp innermost (`elastrain.workers.strategies.mesh`):

    rank = (dp_rank * S + pp_rank) * T + tp_rank

so the stages of one replica sit on consecutive ranks. Ray Train (like torchrun) packs
consecutive ranks onto the same node, which keeps the latency-bound stage-to-stage
traffic (two P2P messages per micro-batch) and tensor parallelism's all-reduces inside a
node, while the gradient all-reduce between replicas (once per step, coalesced) is the
only traffic that crosses nodes. It also means a lost node takes whole replicas with it
rather than one stage of each.

Process groups come from the (dp, pp, tp) device mesh: a pipeline group per (replica, tp
rank) whose group rank is the stage index (what `PipelineStage` assumes), a data-parallel
group per (stage, tp rank) for the gradient all-reduce, and with T > 1 a tensor-parallel
group per (replica, stage) inside which the stage's layers are split (3-D parallelism).

Data. The loop gives every rank of a replica the same share, cut into its micro-batches.
`step` concatenates them in consecutive groups of up to `M` (the spec's
`strategy.microbatches`) loop micro-batches; each group is one `schedule.step`, split
into `m` EQUAL pipeline micro-batches, `m` the largest divisor of the group's sample count
that is <= `M` (`PipelineStage` sizes its receive buffers from the first micro-batch, so
all micro-batches of a schedule must have one shape; one schedule is kept per shape).
With the usual equal loop micro-batches of size `b`, a full group runs `M` pipeline
micro-batches of exactly `b` samples, and a pipeline step never holds more than `M` loop
micro-batches' worth of activations (`b` being the user's memory knob). Gradients
accumulate across groups when the share holds more than `M` loop micro-batches. Empty
loop micro-batches (see `elastrain.workers.sampler`) simply add no samples; a replica whose whole
share is empty runs no schedule and contributes zero gradients to the all-reduce.

Loss and gradients. The schedule's loss is the micro-batch's SUMMED per-sample loss
(`loss_fn` mean times the micro-batch size) with `scale_grads=False`, so after all
groups each stage holds the gradient of its replica's summed loss. `step` then
multiplies by `loss_scale / dp` and all-reduces (SUM) over the stage's dp group: the
replicas' gradients are AVERAGED, exactly like DDP/FSDP, so `grad_reduction = "mean"` and
the loop passes `loss_scale = layout.dp / global_batch_size`
(what `elastrain.workers.loop` passes for every strategy). Scaling after the sum rather than inside
the loss changes nothing but rounding, and keeps the unscaled loss for the agreement.
Then, like the ddp/fsdp strategies, gradients are clipped to a global norm of
`training.grad_clip` (the norm spans all stages: one scalar all-reduce over the pipeline
group) and AdamW (`elastrain.workers.strategies.base.adamw`) steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.utils._pytree import tree_map_only

from elastrain.contracts.messages import Control
from elastrain.contracts.spec import JobSpec, MixedPrecision, PipelineSchedule
from elastrain.workers.agreement import StepAgreement
from elastrain.workers.api import TrainContext, Workload
from elastrain.workers.strategies.base import (
    Layout,
    MicroBatch,
    StepResult,
    Strategy,
    adamw,
    no_staging_wait,
    to_device,
)
from elastrain.workers.strategies.collectives import all_reduce_scaled, broadcast_from_first, local
from elastrain.workers.strategies.ddp import grad_clip_of
from elastrain.workers.strategies.grad_norm import clip_grads_
from elastrain.workers.strategies.mesh import grid_layout, grid_mesh
from elastrain.workers.workloads import WorkloadError

log = logging.getLogger(__name__)

# Pipeline checkpoints flatten the optimizer state to per-FQN keys
# (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`). The nested default keeps one
# `param_groups` list per rank naming only that stage's parameters; DCP dedups it by key,
# so one stage's list would overwrite the other's. Flat keys are disjoint per stage.
CHECKPOINT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------------------------------
# Layout (pure functions, no process group needed)
# ---------------------------------------------------------------------------------------


def pipeline_layout(rank: int, world_size: int, stages: int, tp: int = 1) -> Layout:
    """Replica-major layout: `rank = (dp_rank * stages + pp_rank) * tp + tp_rank`."""
    if stages < 1:
        raise ValueError(f"strategy.pipeline_stages must be >= 1, got {stages}")
    return grid_layout(rank, world_size, pp=stages, tp=tp)


def pipeline_chunks(num_samples: int, max_chunks: int) -> int:
    """How many equal pipeline micro-batches `num_samples` splits into: the largest
    divisor of `num_samples` that is <= `max_chunks` (1 when nothing else divides)."""
    if num_samples < 1 or max_chunks < 1:
        raise ValueError(f"need >= 1 sample and chunk, got {num_samples}, {max_chunks}")
    return next(m for m in range(min(num_samples, max_chunks), 0, -1) if num_samples % m == 0)


@dataclass(frozen=True)
class PipelineOptions:
    stages: int
    microbatches: int
    schedule: PipelineSchedule

    @classmethod
    def from_spec(cls, spec: JobSpec) -> PipelineOptions:
        """The spec's pipeline settings, its defaults filled in."""
        strategy = spec.strategy
        if strategy.mixed_precision is MixedPrecision.fp16:
            # fp16 needs loss scaling inside the schedule's backward; bf16 has fp32's range.
            raise WorkloadError("strategy.mixed_precision: pipeline stages train in bf16, not fp16")
        return cls(
            stages=strategy.stages,
            microbatches=strategy.n_microbatches,
            schedule=strategy.pipeline_schedule,
        )


# ---------------------------------------------------------------------------------------
# Strategy
# ---------------------------------------------------------------------------------------


_ScheduleKey = tuple[int, torch.Size, torch.dtype, torch.Size, torch.dtype]


class PipelineStrategy(Strategy):
    """One pipeline stage of one replica; see the module docstring for the layout."""

    checkpoint_options = CHECKPOINT_OPTIONS

    def __init__(self, *, grad_clip: float | EllipsisType | None = ...) -> None:
        # `...`: the spec's training.grad_clip (set in setup); tests may override it.
        self.grad_clip: float | None = None
        self._grad_clip_override = grad_clip

    def setup(self, workload: Workload, ctx: TrainContext, spec: JobSpec) -> None:
        opts = PipelineOptions.from_spec(spec)
        self.options = opts
        self.layout = pipeline_layout(
            ctx.rank, ctx.world_size, opts.stages, spec.strategy.tensor_parallel_degree
        )
        self.device = ctx.device
        if not hasattr(workload.model, "pipeline_stage"):
            raise WorkloadError(
                "strategy.kind 'pipeline' needs a model with "
                "pipeline_stage(stage_index, num_stages); this workload's model has none"
            )
        mesh = grid_mesh(self.device.type, self.layout)
        # Group rank == stage index in the pp group, as `PipelineStage` assumes.
        self._pp_group = mesh["pp"].get_group()
        self._dp_group = mesh["dp"].get_group() if self.layout.dp > 1 else None
        self._tp_group = mesh["tp"].get_group() if self.layout.tp > 1 else None

        build_stage = cast(Callable[[int, int], nn.Module], workload.model.pipeline_stage)
        stage_module = build_stage(self.layout.pp_rank, opts.stages)
        self.model = stage_module.to(self.device)
        # bf16: each stage's forward (and the last one's loss) under autocast, parameters in
        # fp32, as DDP and tp do; stage-to-stage activations stay fp32 (`_autocast_stage`).
        self._autocast_dtype = torch.bfloat16 if spec.strategy.mixed_precision else None
        if self._autocast_dtype is not None:
            _autocast_stage(
                self.model, self.device.type, last=self.layout.pp_rank == opts.stages - 1
            )
        if self.layout.tp > 1:
            from elastrain.workers.strategies.tensor_parallel import parallelize

            # Stage-to-stage messages stay plain tensors (the plan's outputs are local),
            # each tensor-parallel rank talking to the same one of the next stage.
            parallelize(self.model, mesh["tp"])
        self.is_first = self.layout.pp_rank == 0
        self.is_last = self.layout.pp_rank == opts.stages - 1
        self._broadcast_params()
        # Same optimizer as ddp/fsdp, so a job's loss curve does not depend on the strategy.
        self.optimizer = adamw(self.model.parameters(), spec)
        self.grad_clip = grad_clip_of(spec, self._grad_clip_override)
        self._workload_loss = workload.loss_fn
        # One (stage, schedule) per micro-batch shape; usually one or two entries.
        self._schedules: dict[_ScheduleKey, PipelineScheduleSingle] = {}

    # -- process groups ----------------------------------------------------------------

    def _broadcast_params(self) -> None:
        """Replicas start identical (as DDP does): dp rank 0's stage parameters win."""
        if self._dp_group is None:
            return
        with torch.no_grad():
            tensors = [p.data for p in self.model.parameters()]
            tensors += [b for b in self.model.buffers()]
            broadcast_from_first(tensors, self._dp_group)

    # -- schedules ---------------------------------------------------------------------

    def _schedule_for(
        self, chunks: int, inputs: torch.Tensor, targets: torch.Tensor
    ) -> PipelineScheduleSingle:
        key: _ScheduleKey = (chunks, inputs.shape, inputs.dtype, targets.shape, targets.dtype)
        schedule = self._schedules.get(key)
        if schedule is not None:
            return schedule
        # Every stage of the replica sees the same data, hence builds the same key at the
        # same step; the first `step` of a new schedule runs the stages' metadata handshake.
        stage = PipelineStage(
            self.model,
            self.layout.pp_rank,
            self.options.stages,
            self.device,
            group=self._pp_group,
        )
        # 1F1B needs at least as many micro-batches as stages; below that it would be
        # GPipe anyway (same gradients, different order).
        cls: type[ScheduleGPipe] | type[Schedule1F1B] = ScheduleGPipe
        if self.options.schedule is PipelineSchedule.one_f_one_b and chunks >= self.options.stages:
            cls = Schedule1F1B
        schedule = cls(stage, n_microbatches=chunks, loss_fn=self._sum_loss, scale_grads=False)
        self._schedules[key] = schedule
        log.debug("pipeline: new %s for key %s", cls.__name__, key)
        return schedule

    def _sum_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed per-sample loss (the workload's loss is a mean), under
        autocast with bf16 as a DDP rank's loss is (its cross-entropy in fp32)."""
        with torch.autocast(
            self.device.type, dtype=self._autocast_dtype or torch.bfloat16,
            enabled=self._autocast_dtype is not None,
        ):  # fmt: skip
            return self._workload_loss(output, target) * target.shape[0]

    # -- training ----------------------------------------------------------------------

    def _schedule_steps(
        self, microbatches: Sequence[MicroBatch]
    ) -> Iterator[tuple[PipelineScheduleSingle, int, tuple[torch.Tensor, ...], torch.Tensor]]:
        """The schedule runs of a share: consecutive groups of up to `microbatches` loop
        micro-batches, each as (schedule, chunks, the first stage's args, targets), on the
        device. Empty groups are skipped: every stage of the replica has the same data, so
        all skip together."""
        per_step = self.options.microbatches
        for start in range(0, len(microbatches), per_step):
            group = microbatches[start : start + per_step]
            inputs = torch.cat([x for x, _ in group])
            targets = torch.cat([y for _, y in group])
            if inputs.shape[0] == 0:
                continue
            chunks = pipeline_chunks(inputs.shape[0], per_step)
            schedule = self._schedule_for(chunks, inputs, targets)
            args = (to_device(inputs, self.device),) if self.is_first else ()
            yield schedule, chunks, args, to_device(targets, self.device)

    def step(
        self,
        microbatches: Sequence[MicroBatch],
        *,
        loss_scale: float,
        lr: float,
        control: Control = Control.NONE,
        wait_staged: Callable[[], float] = no_staging_wait,
    ) -> StepResult:
        if not microbatches:
            raise ValueError("a pipeline step needs at least one micro-batch")
        # What every rank must hold alike before any updates its weights: the global loss
        # and rank 0's control (`elastrain.workers.agreement`).
        agreement = StepAgreement(control)
        self.optimizer.zero_grad(set_to_none=True)

        # Gradient accumulation: one schedule run per group of loop micro-batches (each
        # run interleaves its chunks' forwards and backwards over the stages); gradients
        # add up across runs and are synchronised over the replicas once, after the last.
        loss_sum = torch.zeros((), device=self.device)
        for schedule, chunks, args, targets in self._schedule_steps(microbatches):
            loss_sum += self._run_schedule(schedule, chunks, args, targets)
        self._scale_and_sync_grads(loss_scale)
        agreement.offer(loss_sum if self._reports_loss else torch.zeros_like(loss_sum))

        # The clipping's norm all-reduce over the stages carries the agreement where that
        # sums over every rank (one replica); else it goes on its own now, in flight while
        # the gradients are clipped.
        clipping_carries = self._clipping_carries(agreement)
        if not clipping_carries:
            agreement.start()
        if self.grad_clip is not None:
            self._clip_grads(self.grad_clip, agreement if clipping_carries else None)
        loss_total, agreed = agreement.wait()

        # The update, once an async checkpoint's staging copy of the weights is complete.
        staging_wait_s = wait_staged()
        self._set_lr(lr)
        self.optimizer.step()
        return StepResult(loss_sum=loss_total, control=agreed, staging_wait_s=staging_wait_s)

    def _run_schedule(
        self,
        schedule: PipelineScheduleSingle,
        chunks: int,
        args: tuple[torch.Tensor, ...],
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """One schedule run's forwards and backwards; its summed loss on the last stage
        (0 elsewhere)."""
        # The meter sees every chunk's forward, counted per chunk (the stage's activations
        # per micro-batch).
        with self.activations.measuring(per=chunks):
            if not self.is_last:
                schedule.step(*args, return_outputs=False)
                return torch.zeros((), device=self.device)
            losses: list[torch.Tensor] = []
            schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        return torch.stack([loss.detach() for loss in losses]).sum()

    @property
    def _reports_loss(self) -> bool:
        """The last stage holds the loss; its tensor-parallel ranks all hold the same one."""
        return self.is_last and self.layout.tp_rank == 0

    def evaluate(self, microbatches: Sequence[MicroBatch]) -> float:
        """The schedule's forward-only run (`eval`) over the same chunking as training; the
        loss is on the last stage."""
        was_training = self.model.training
        self.model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for schedule, _, args, targets in self._schedule_steps(microbatches):
                    if self.is_last:
                        losses: list[torch.Tensor] = []
                        schedule.eval(*args, target=targets, losses=losses)
                        total += float(torch.stack([loss.detach() for loss in losses]).sum())
                    else:
                        schedule.eval(*args)
        finally:
            self.model.train(was_training)
        return total if self._reports_loss else 0.0

    @property
    def _norm_spans_world(self) -> bool:
        # The clipping's all-reduces (over the stage's tp ranks, then over the stages)
        # together sum over every rank when there is one replica.
        return self.layout.dp == 1 and bool(self._norm_groups())

    def _scale_and_sync_grads(self, loss_scale: float) -> None:
        """grad <- mean over replicas of (loss_scale * grad)."""
        # A parameter without a gradient (an empty share, an unused branch) gets zeros, so
        # every replica all-reduces the same buckets and the result does not depend on
        # which replica saw which samples.
        for p in self.model.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        if self._dp_group is None:
            torch._foreach_mul_([local(g) for g in grads], loss_scale)
            return
        all_reduce_scaled(grads, loss_scale / self.layout.dp, self._dp_group)

    def _clip_grads(self, max_norm: float, carry: StepAgreement | None = None) -> None:
        """`clip_grad_norm_` over the whole model: each stage holds a disjoint part of the
        parameters, so the squared norms are summed over the tensor-parallel ranks of the
        stage, then over the pipeline group."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        clip_grads_(grads, max_norm, self._norm_groups(), self.device, carry)

    def _norm_groups(self) -> list[dist.ProcessGroup | None]:
        groups: list[dist.ProcessGroup | None] = []
        if self._tp_group is not None:
            groups.append(self._tp_group)
        if self.options.stages > 1:
            groups.append(self._pp_group)
        return groups

    # -- checkpoints -------------------------------------------------------------------


def _autocast_stage(stage: nn.Module, device_type: str, *, last: bool) -> None:
    """Run `stage`'s forward under bf16 autocast (on the instance: parameter names do not
    change). A stage that sends its output on gets it back in fp32 where autocast left
    bf16: the next stage's buffers are made from a forward without autocast (the
    schedule's shape inference), so what is sent keeps the dtype they expect."""
    forward = stage.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        if last:
            return out
        return tree_map_only(
            torch.Tensor, lambda t: t.float() if t.dtype == torch.bfloat16 else t, out
        )

    stage.forward = run
