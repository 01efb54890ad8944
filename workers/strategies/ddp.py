"""Data parallelism: `DataParallelStrategy` (the step ddp, fsdp and tp share) and
`DDPStrategy`, whose gradient all-reduce carries the step agreement (its comm hook).

Every rank is one data-parallel replica (Layout dp = world_size). Gradient accumulation
over the micro-batches skips gradient sync on all but the last one; the loop's
`loss_scale` (dp / G) makes the synced, dp-averaged gradient equal the gradient of the
global-batch mean loss whatever the world size.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import EllipsisType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from elastrain.contracts.messages import Control
from elastrain.contracts.spec import JobSpec, MixedPrecision
from elastrain.workers.agreement import StepAgreement
from elastrain.workers.api import TrainContext, Workload
from elastrain.workers.strategies.base import (
    Layout,
    MicroBatch,
    StepResult,
    Strategy,
    adamw,
    microbatch_loss,
    no_staging_wait,
    to_device,
)
from elastrain.workers.strategies.grad_norm import clip_grads_
from elastrain.workers.workloads import WorkloadError


def grad_clip_of(spec: JobSpec, override: float | EllipsisType | None) -> float | None:
    """The max gradient norm: the spec's, unless the strategy was built with another."""
    return spec.training.grad_clip if override is ... else override


_DTYPES = {MixedPrecision.bf16: torch.bfloat16, MixedPrecision.fp16: torch.float16}


class DataParallelStrategy(Strategy):
    """The step shared by ddp, fsdp and tp; subclasses wrap the model, switch gradient
    sync and say whether their gradient sync can carry the step agreement."""

    def __init__(self, *, grad_clip: float | EllipsisType | None = ...) -> None:
        # `...`: the spec's training.grad_clip (set in setup); tests may override it.
        self.grad_clip: float | None = None
        self._grad_clip_override = grad_clip
        self.autocast_dtype: torch.dtype | None = None
        self.scaler: torch.amp.GradScaler | None = None

    def setup(self, workload: Workload, ctx: TrainContext, spec: JobSpec) -> None:
        self.device = ctx.device
        self.spec = spec
        self.loss_fn = workload.loss_fn
        self.layout = self.make_layout(ctx, spec)
        # The tensor-parallel ranks of a replica compute the same loss: one reports it.
        self._reports_loss = self.layout.tp_rank == 0
        precision = spec.strategy.mixed_precision
        if precision is not None and ctx.device.type != "cuda":
            raise WorkloadError(
                f"strategy.mixed_precision={precision.value!r} needs a GPU (device is cpu)"
            )
        dtype = _DTYPES[precision] if precision is not None else None
        self.model = self.wrap(workload.model.to(ctx.device), dtype)
        if precision is MixedPrecision.fp16:
            # fp16 gradients underflow without loss scaling; bf16 has fp32's range.
            self.scaler = torch.amp.GradScaler(ctx.device.type)
        self.optimizer = adamw(self.model.parameters(), spec)
        self.grad_clip = grad_clip_of(spec, self._grad_clip_override)

    def make_layout(self, ctx: TrainContext, spec: JobSpec) -> Layout:
        """Every rank is one replica, unless the strategy splits the model (tp)."""
        return Layout(dp=ctx.world_size, dp_rank=ctx.rank)

    @abstractmethod
    def wrap(self, model: nn.Module, mixed_precision: torch.dtype | None) -> nn.Module:
        """Wrap the model (already on the device) for data parallelism."""

    @abstractmethod
    def grad_sync(self, enabled: bool) -> AbstractContextManager[None]:
        """A context under which backward syncs gradients across replicas or not."""

    def step(
        self,
        microbatches: Sequence[MicroBatch],
        *,
        loss_scale: float,
        lr: float,
        control: Control = Control.NONE,
        wait_staged: Callable[[], float] = no_staging_wait,
    ) -> StepResult:
        # What every rank must hold alike before any updates its weights: the global loss
        # and rank 0's control (`elastrain.workers.agreement`).
        agreement = StepAgreement(control)
        self.optimizer.zero_grad(set_to_none=True)

        # Gradient accumulation: gradients are synchronised only by the last micro-batch's
        # backward (DDP's no_sync, FSDP's requires_gradient_sync off, tp's own all-reduce).
        loss_sum = torch.zeros((), device=self.device)
        last = len(microbatches) - 1
        for i, (inputs, targets) in enumerate(microbatches):
            with self.grad_sync(i == last):
                loss, summed = self._forward(inputs, targets, loss_scale)
                loss_sum += summed
                if i == last:
                    # This rank's loss is known before the last backward: DDP's first
                    # gradient bucket carries the agreement (`allreduce_carrying_agreement`).
                    agreement.offer(self._reported(loss_sum))
                    self.carry_in_gradient_sync(agreement)
                if self.scaler is not None:
                    loss = self.scaler.scale(loss)  # fp16: scaled, or small gradients underflow
                loss.backward()

        # Not carried yet: the clipping's norm all-reduce carries the agreement where that
        # sums over every rank (FSDP, tensor parallel with one replica); else it goes on its
        # own now, in flight while the gradients are unscaled and clipped.
        clipping_carries = self._clipping_carries(agreement)
        if not clipping_carries:
            agreement.start()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        if self.grad_clip is not None:
            self.clip_gradients(self.grad_clip, agreement if clipping_carries else None)
        loss_total, agreed = agreement.wait()

        # The update: the only part that changes weights and optimizer state, so an async
        # checkpoint's staging copy (made during this step's forward and backward) must be
        # complete first, or this step would leak into the previous step's checkpoint.
        staging_wait_s = wait_staged()
        self._set_lr(lr)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when the gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        return StepResult(loss_sum=loss_total, control=agreed, staging_wait_s=staging_wait_s)

    def _forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's forward: (loss to call backward on, detached summed loss)."""
        inputs = to_device(inputs, self.device)
        targets = to_device(targets, self.device)
        # Forward only under autocast: backward under autocast is discouraged.
        with self._autocast(), self.activations.measuring():
            loss, summed = microbatch_loss(self.model, self.loss_fn, inputs, targets, loss_scale)
        return loss, summed.float()

    def _reported(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum if self._reports_loss else torch.zeros_like(loss_sum)

    def carry_in_gradient_sync(self, agreement: StepAgreement) -> None:
        """Have the last micro-batch's gradient sync carry `agreement`, where it can (DDP)."""

    def evaluate(self, microbatches: Sequence[MicroBatch]) -> float:
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        try:
            with torch.no_grad(), self._autocast():
                for inputs, targets in microbatches:
                    inputs = to_device(inputs, self.device)
                    if inputs.shape[0] == 0:  # an empty share still joins FSDP's gathers
                        self.model(inputs.new_zeros((1, *inputs.shape[1:])))
                        continue
                    targets = to_device(targets, self.device)
                    total += self.loss_fn(self.model(inputs), targets).float() * inputs.shape[0]
        finally:
            self.model.train(was_training)
        return float(total.item()) if self._reports_loss else 0.0

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def clip_gradients(self, max_norm: float, carry: StepAgreement | None = None) -> None:
        """Scale the gradients to a global norm of at most `max_norm`; `carry`: a step
        agreement for the norm's all-reduce to carry (only where `_norm_spans_world`)."""
        if self._norm_is_local:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            # Split or sharded parameters: one all-reduce of the squared norm over every
            # rank that holds a part of the model (`grad_norm`), the same bits on all.
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            clip_grads_(grads, max_norm, [self.norm_group], self.device, carry)

    @property
    def _norm_is_local(self) -> bool:
        # Replicated gradients (DDP) need no collective. FSDP's offloaded gradients live
        # in host memory, apart from the device its norm all-reduce runs on: torch's
        # clipping (DTensor) handles that.
        return self.layout.tp == 1 and (self.full_replica or self.spec.strategy.cpu_offload)

    @property
    def _norm_spans_world(self) -> bool:
        if self._norm_is_local:
            return False
        return (
            self.norm_group is None or dist.get_world_size(self.norm_group) == dist.get_world_size()
        )

    #: The ranks whose gradients together make the whole model's (tensor parallel: the
    #: tp group, since replicas hold the same averaged gradients; None: every rank).
    norm_group: dist.ProcessGroup | None = None


#: Gradient buckets precise enough to carry a loss sum (fp16/bf16 ones are not: the
#: agreement then goes on its own).
_CARRYING_DTYPES = (torch.float32, torch.float64)


class AgreementCarrier:
    """The state of DDP's comm hook: the step agreement its next sync is to carry."""

    def __init__(self) -> None:
        self.agreement: StepAgreement | None = None


def allreduce_carrying_agreement(
    carrier: AgreementCarrier, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (gradients averaged over the ranks), except that the first
    bucket of a sync that has a step agreement to carry sums the agreement's two values
    with the gradients, in one collective (`elastrain.workers.agreement`). The first bucket is
    reduced first (the last layers' gradients, DDP's small first bucket), and every rank
    hands over an agreement at the same step, so every rank packs alike."""
    agreement, grads = carrier.agreement, bucket.buffer()
    if agreement is None or bucket.index() != 0 or grads.dtype not in _CARRYING_DTYPES:
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
    carrier.agreement = None
    n = grads.numel()
    packed = torch.cat([grads.div_(dist.get_world_size()), agreement.payload(grads.dtype)])
    future = dist.all_reduce(packed, async_op=True).get_future()

    def unpack(done: torch.futures.Future[Any]) -> torch.Tensor:
        summed: torch.Tensor = done.value()[0]
        agreement.carried(summed[n:].float())
        return grads.copy_(summed[:n])

    return future.then(unpack)


# DDP checks a hook's annotations as objects; this module's are strings (postponed).
allreduce_carrying_agreement.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


class DDPStrategy(DataParallelStrategy):
    """`DistributedDataParallel`: full replica per rank, gradients all-reduced (averaged)."""

    full_replica = True

    def wrap(self, model: nn.Module, mixed_precision: torch.dtype | None) -> nn.Module:
        # DDP keeps fp32 parameters; mixed precision is autocast around the forward.
        self.autocast_dtype = mixed_precision
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        self._carrier = AgreementCarrier()
        ddp.register_comm_hook(self._carrier, allreduce_carrying_agreement)
        return ddp

    def carry_in_gradient_sync(self, agreement: StepAgreement) -> None:
        if self.agreement_rides_collectives:
            self._carrier.agreement = agreement

    def grad_sync(self, enabled: bool) -> AbstractContextManager[None]:
        assert isinstance(self.model, DistributedDataParallel)
        return contextlib.nullcontext() if enabled else self.model.no_sync()
