"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Each of `model.shard_units()` (e.g. transformer blocks) becomes its own FSDP unit, so only
one block's full parameters are gathered at a time; the root unit takes what is left
(embeddings, head). Parameters are DTensors sharded on dim 0 over a 1-D mesh of all ranks.

With `strategy.tensor_parallel: N` (2-D, as torchtitan composes them) the model is first
split over groups of N consecutive ranks (`elastrain.workers.strategies.tensor_parallel`), then
FSDP shards each tensor-parallel shard over the data-parallel ranks of the (dp, tp) mesh:
parameters are DTensors placed (Shard(0) over dp, their tp placement over tp).

The step is `DataParallelStrategy.step` (`elastrain.workers.strategies.ddp`): with gradient sync off,
FSDP2 accumulates unsharded gradients and reduce-scatters them at the last micro-batch's
backward; the step agreement rides the clipping's squared-norm all-reduce, if any.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.comm_release import group_forming
from elastrain.workers.strategies.base import Layout
from elastrain.workers.strategies.ddp import DataParallelStrategy
from elastrain.workers.strategies.mesh import grid_layout, grid_mesh


class FSDPStrategy(DataParallelStrategy):
    def make_layout(self, ctx: TrainContext, spec: JobSpec) -> Layout:
        return grid_layout(ctx.rank, ctx.world_size, tp=spec.strategy.tensor_parallel_degree)

    def wrap(self, model: nn.Module, mixed_precision: torch.dtype | None) -> nn.Module:
        if self.layout.tp > 1:
            from elastrain.workers.strategies.tensor_parallel import parallelize

            grid = grid_mesh(self.device.type, self.layout)
            parallelize(model, grid["tp"])
            mesh = grid["dp"]
        else:
            with group_forming():
                mesh = init_device_mesh(self.device.type, (self.layout.dp,))
        # Compute in low precision, but reduce gradients (and keep the sharded master
        # parameters and optimizer state) in fp32 so accumulation does not lose bits.
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
            if mixed_precision is not None
            else MixedPrecisionPolicy()
        )
        # Offload: the sharded parameters, their gradients and so the optimizer state (and
        # step) live in pinned host memory; each unit's parameters are copied to the
        # device for its forward and backward only.
        offload = CPUOffloadPolicy() if self.spec.strategy.cpu_offload else OffloadPolicy()
        shard_units = getattr(model, "shard_units", None)
        for unit in shard_units() if callable(shard_units) else []:
            fully_shard(unit, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
        return model

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        # Without sync, FSDP2 keeps accumulating unsharded gradients locally and
        # reduce-scatters them all at the last micro-batch's backward.
        model = self.model
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(enabled)
        yield
