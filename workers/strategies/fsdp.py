"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Each of `model.shard_units()` (e.g. transformer blocks) becomes its own FSDP unit, so only
one block's full parameters are gathered at a time; the root unit takes what is left
(embeddings, head). Parameters are DTensors sharded on dim 0 over a 1-D mesh of all ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from workers.strategies.ddp import DataParallelStrategy


class FSDPStrategy(DataParallelStrategy):
    def wrap(self, model: nn.Module, mixed_precision: torch.dtype | None) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.layout.dp,))
        # Compute in low precision, but reduce gradients (and keep the sharded master
        # parameters and optimizer state) in fp32 so accumulation does not lose bits.
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
            if mixed_precision is not None
            else MixedPrecisionPolicy()
        )
        shard_units = getattr(model, "shard_units", None)
        for unit in shard_units() if callable(shard_units) else []:
            fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return model

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        # Without sync, FSDP2 keeps accumulating unsharded gradients locally and
        # reduce-scatters them all at the last micro-batch's backward.
        model = self.model
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(enabled)
        yield
