"""The interface every parallelism strategy (ddp, fsdp, tp, pipeline) implements.

The loop owns the data: for every optimizer step it hands the strategy's `step` this
rank's share of the global batch already cut into micro-batches, plus `loss_scale`, the
factor that turns a micro-batch's summed loss into this rank's contribution to the
global-batch mean (so gradients are identical whatever the world size), and gets back
what every rank agreed on (the global loss, rank 0's control). The strategy owns
everything about how the model is placed, wrapped, run and synchronised; each `step`
reads top to bottom: zero-grad, the micro-batches, clipping, the update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastrain.contracts.messages import Control
from elastrain.contracts.spec import JobSpec
from elastrain.workers.activation import ActivationMeter
from elastrain.workers.agreement import StepAgreement
from elastrain.workers.api import TrainContext, Workload
from elastrain.workers.strategies.collectives import local


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a batch from the host) on `device`, without stalling the host. From pageable
    memory, a host-to-device copy first waits for every kernel already queued on the
    stream (CUDA's rule for pageable sources); inside a step that made the host wait for
    each micro-batch's backward before it could launch the next forward, so the GPU sat
    idle while the host launched kernels (seen on an H100: docs/bench-gpu.md). From pinned
    memory the copy is queued like a kernel. On the CPU: `t` itself."""
    if t.device == device:
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def adamw(params: Iterable[torch.Tensor], spec: JobSpec) -> torch.optim.AdamW:
    """The optimizer of every strategy (so a job's loss curve does not depend on the
    strategy): AdamW at the spec's learning rate and weight decay.

    Neither `foreach` nor `fused` is passed, on purpose: only then does torch choose the
    implementation by device (torch/optim/adam.py), multi-tensor (foreach) on a GPU and
    single-tensor on a CPU. Passing `fused=False`, as this did, also turned foreach off:
    on a GPU each step then ran AdamW one parameter at a time, about 9 kernel launches
    per parameter (~1,350 for the 12-layer gpt, over a third of its step's launches;
    under FSDP2 each one a DTensor dispatch), on a step bound by the host's launches
    (docs/bench-gpu.md). Both are deterministic; fused stays off (torch's default).
    """
    return torch.optim.AdamW(
        params,
        lr=spec.training.learning_rate,
        weight_decay=spec.training.weight_decay,
    )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the world is divided: `dp` data-parallel replicas, each of `pp` pipeline
    stages, each stage split over `tp` tensor-parallel ranks (world = dp * pp * tp).

    The loop splits the global batch over the `dp` replicas; all ranks of one replica see
    the same share. Ranks are numbered with tp innermost, then pp, then dp
    (`elastrain.workers.strategies.mesh`).
    """

    dp: int
    pp: int = 1
    tp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0


#: One micro-batch as the loop hands it over: (inputs, targets), on the host.
MicroBatch = tuple[torch.Tensor, torch.Tensor]


def no_staging_wait() -> float:
    """`Strategy.step`'s `wait_staged` when no checkpoint copy can be pending."""
    return 0.0


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One optimizer step as every rank agreed on it (`elastrain.workers.agreement`)."""

    loss_sum: float
    """The global batch's summed per-sample loss, the same on every rank (the loop divides
    it by the global batch size for the point on the loss curve)."""
    control: Control
    """Rank 0's control (checkpoint, stop), the same on every rank: all act on it at
    this step."""
    staging_wait_s: float = 0.0
    """Seconds the step waited, before its update, for an async checkpoint's staging copy."""


class Strategy(ABC):
    """One instance per rank per attempt."""

    layout: Layout
    model: nn.Module
    optimizer: torch.optim.Optimizer
    #: `StateDictOptions` for get/set_state_dict; a strategy whose ranks hold different
    #: parameter sets (pipeline stages) needs flattened optimizer state.
    checkpoint_options: Any = None

    #: Every rank holds the whole model and optimizer state (ddp): a new group can take
    #: the state from any surviving rank's memory instead of from a checkpoint.
    full_replica: bool = False

    #: The max gradient norm (None: no clipping); set in `setup`.
    grad_clip: float | None = None

    #: Whether the step agreement may ride a collective the step makes anyway (DDP's first
    #: gradient bucket, the clipping's norm all-reduce); off, it always takes an
    #: all-reduce of its own (what it costs, and that riding changes no weight, is
    #: measured and tested against this).
    agreement_rides_collectives: bool = True

    @abstractmethod
    def setup(self, workload: Workload, ctx: TrainContext, spec: JobSpec) -> None:
        """Place and wrap `workload.model`, build the optimizer (AdamW, spec lr)."""

    @abstractmethod
    def step(
        self,
        microbatches: Sequence[MicroBatch],
        *,
        loss_scale: float,
        lr: float,
        control: Control = Control.NONE,
        wait_staged: Callable[[], float] = no_staging_wait,
    ) -> StepResult:
        """One optimizer step over this rank's share of the global batch, cut into
        `microbatches`: zero the gradients, accumulate over the micro-batches (gradients
        synchronised once, with the last), clip, then update the weights at `lr`.

        `loss_scale` turns a micro-batch's summed loss into this rank's share of the
        global-batch mean. Every rank of a collective group must get the same number of
        micro-batches (the loop guarantees it), so collectives stay in lockstep.
        `control` is rank 0's request (NONE elsewhere): before any rank updates its
        weights, every rank agrees on it and on the global loss (`elastrain.workers.agreement`).
        `wait_staged` is called just before the update: an async checkpoint's staging copy
        of the weights must be complete by then.
        """

    @property
    def activations(self) -> ActivationMeter:
        """What this rank's forwards keep for backward (`activation_bytes` in the metrics)."""
        meter = self.__dict__.get("_activations")
        if meter is None:
            meter = self.__dict__["_activations"] = ActivationMeter()
        return meter

    def evaluate(self, microbatches: Sequence[MicroBatch]) -> float:
        """Forward only, without dropout: this rank's summed per-sample loss over its share
        (0 where a rank sees no loss). Every rank of a group gets the same number of
        micro-batches, as in training, since forwards may hold collectives (FSDP)."""
        raise NotImplementedError(f"{type(self).__name__} cannot evaluate")

    def _clipping_carries(self, agreement: StepAgreement) -> bool:
        """Whether the clipping's norm all-reduce is to carry `agreement`: it is not carried
        yet, there is clipping, and its all-reduce sums over every rank."""
        return (
            self.agreement_rides_collectives
            and not agreement.settled
            and self.grad_clip is not None
            and self._norm_spans_world
        )

    @property
    def _norm_spans_world(self) -> bool:
        """Whether gradient clipping's norm all-reduce sums over every rank."""
        return False

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict_for_checkpoint(self, *, copy_buffers: bool = False) -> dict[str, Any]:
        """Model and optimizer state keyed by FQN, as `torch.distributed.checkpoint` wants
        (DTensors for fsdp), loadable at any other world size or split. Its tensors are the
        live ones; `copy_buffers`: the module buffers' are copies, for a save that writes
        the live tensors while the next forward runs (a forward may change buffers in
        place: batch-norm statistics, DDP's broadcast of them); the weights and optimizer
        state change only in the update."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=self.checkpoint_options
        )
        if copy_buffers:
            buffers = {local(b).data_ptr() for b in self.model.buffers()}
            model_sd = {
                key: value.clone()
                if isinstance(value, torch.Tensor) and local(value).data_ptr() in buffers
                else value
                for key, value in model_sd.items()
            }
        return {"model": model_sd, "optim": optim_sd}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.checkpoint_options,
        )

    def memory_bytes(self) -> dict[str, int]:
        """Parameter, gradient and optimizer-state bytes held by this rank (local shards,
        in host memory under FSDP's cpu_offload), the peak activation bytes and, on a GPU,
        the device's peak allocation since the last call."""

        def local_bytes(t: torch.Tensor) -> int:
            shard = local(t)
            return shard.numel() * shard.element_size()

        params = sum(local_bytes(p) for p in self.model.parameters())
        grads = sum(local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        optim = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    optim += local_bytes(value)
        out = {
            "param_bytes": params,
            "grad_bytes": grads,
            "optim_bytes": optim,
            # The most one micro-batch's forward kept for backward since the last report.
            "activation_bytes": self.activations.peak,
        }
        device: torch.device | None = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            # What the device held at most since the last report (each report starts a
            # new window): the measured effect of offload and activation checkpointing.
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        return out


def microbatch_loss(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one micro-batch: (loss to call `.backward()` on, detached summed loss).

    The workload's loss is a mean over the micro-batch; times its size it becomes a sum,
    and `loss_scale` turns that into this rank's share of the global-batch mean.

    An EMPTY micro-batch (size 0 along dim 0, see `elastrain.workers.sampler`) still runs a forward
    and backward, on one all-zero dummy sample with a zero weight: every parameter then
    gets a zero gradient and the replica joins the same gradient collectives as the
    others. Zeros keep the trailing shape and dtype the loop gave the empty tensors, and
    are valid token ids and features alike.
    """
    n = inputs.shape[0]
    if n == 0:
        dummy_in = inputs.new_zeros((1, *inputs.shape[1:]))
        dummy_target = targets.new_zeros((1, *targets.shape[1:]))
        loss = loss_fn(model(dummy_in), dummy_target)
        return loss * 0.0, torch.zeros((), device=loss.device)
    summed = loss_fn(model(inputs), targets) * n
    return summed * loss_scale, summed.detach()
