"""Activation checkpointing, and a meter of the activation memory a forward keeps.

`training.activation_checkpointing`:

- `none`: autograd keeps every intermediate a unit's backward needs.
- `full`: each of `model.shard_units()` (the gpt's transformer blocks) keeps only its input;
  its forward runs again inside its backward (`torch.utils.checkpoint`, non-reentrant, so it
  composes with DDP and FSDP2 and with pipeline stages).
- `selective`: every second unit (the layer-selective variant torchtitan offers), trading
  half of the saving for half of the recomputation.

Units are checkpointed by replacing their `forward` on the instance, not by wrapping the
module, so parameter names (FQNs) do not change and checkpoints load whatever the setting.
Applied before the strategy wraps the model (as torchtitan does before `fully_shard`).

The meter counts what a micro-batch's forward leaves for its backward: every tensor
autograd saves (once per storage; parameters excluded, they are not activations) plus the
inputs a checkpointed unit keeps in place of its intermediates (autograd does not see those:
non-reentrant checkpointing saves through hooks of its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastrain.contracts.spec import ActivationCheckpointing
from elastrain.workers.workloads import WorkloadError


class ActivationMeter:
    def __init__(self) -> None:
        self.peak = 0
        """The most bytes one micro-batch's forward kept, since the last `reset`."""
        self.armed = True
        """Off: `measuring` counts nothing (the loop measures memory every few seconds, not
        every step)."""
        self._seen: set[int] | None = None
        self._bytes = 0

    def reset(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def measuring(self, per: int = 1) -> Iterator[None]:
        """Around one forward (or `per` micro-batches' forwards): the bytes saved, divided
        by `per`, count towards `peak`."""
        if not self.armed:
            yield
            return
        self._seen, self._bytes = set(), 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self.peak = max(self.peak, self._bytes // max(1, per))
            self._seen = None

    def add(self, tensors: tuple[Any, ...]) -> None:
        """Tensors kept alive for backward outside autograd's saved tensors."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    def _count(self, t: torch.Tensor) -> None:
        if self._seen is None or _is_parameter(t):
            return
        local = getattr(t, "_local_tensor", None)  # a DTensor (tensor parallel): its shard
        if isinstance(local, torch.Tensor):
            t = local
        storage = t.untyped_storage()
        try:
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:
            # A storage Python cannot address (seen with transformers' llama under the
            # loop): count the tensor's own bytes, once per tensor.
            key, size = id(t), t.numel() * t.element_size()
        if key not in self._seen:
            self._seen.add(key)
            self._bytes += size


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return bool(base.is_leaf and base.requires_grad)


def apply_activation_checkpointing(
    model: nn.Module, mode: ActivationCheckpointing, meter: ActivationMeter
) -> int:
    """Checkpoint the model's units as `mode` says; returns how many were."""
    if mode is ActivationCheckpointing.none:
        return 0
    units = model_units(model, "training.activation_checkpointing")
    every = 2 if mode is ActivationCheckpointing.selective else 1
    chosen = units[::every]
    for unit in chosen:
        unit.forward = _checkpointed(unit.forward, meter)
    return len(chosen)


def model_units(model: nn.Module, field: str) -> list[nn.Module]:
    """The model's blocks (`model.shard_units()`), which `field` acts on one by one."""
    shard_units = getattr(model, "shard_units", None)
    if not callable(shard_units):
        raise WorkloadError(
            f"{field} acts on the model's blocks, and this workload's model has no "
            f"shard_units() naming them; add one, or leave {field} at its default"
        )
    return list(shard_units())


def _checkpointed(forward: Callable[..., Any], meter: ActivationMeter) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        # What checkpoint keeps for the recomputation; not while torch.compile traces the
        # unit (`training.compile`): the meter's storage lookups would break its graph.
        if not torch.compiler.is_compiling():
            meter.add(args)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
