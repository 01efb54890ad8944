"""Tensor parallelism (Megatron-style, on DTensor) and the `tp` strategy.

`parallelize(model, tp_mesh)` applies the model's own `tensor_parallel_plan()` (which
layers split by columns, which by rows; see the gpt workload) and turns every parameter
the plan left whole (layer norms) into a DTensor replicated over the tensor-parallel
ranks. Every parameter is then a DTensor on the same mesh, which is what gradient-norm
clipping, FSDP's 2-D sharding (`fsdp` with `tensor_parallel`) and the distributed
checkpoint need to treat the model as one.

The `tp` strategy runs `dp = world / tp` replicas of a tensor-parallel model. Replicas
average their gradients like DDP, bucketed over the local shards, once per step after
the last micro-batch's backward (DDP's backward-overlapped buckets do not take DTensor
parameters). Elasticity is on dp: the tp degree is fixed for a job. The step is
`DataParallelStrategy.step` (`elastrain.workers.strategies.ddp`), with that all-reduce as its
gradient sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import parallelize_module

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.strategies.base import Layout
from elastrain.workers.strategies.collectives import all_reduce_scaled
from elastrain.workers.strategies.ddp import DataParallelStrategy
from elastrain.workers.strategies.mesh import grid_layout, grid_mesh


def parallelize(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model` in place over `tp_mesh` by its `tensor_parallel_plan()`."""
    plan_of = getattr(model, "tensor_parallel_plan", None)
    if not callable(plan_of):
        raise ValueError(
            "strategy.tensor_parallel needs a model with tensor_parallel_plan() (the built-in "
            "gpt has one); this workload's model has none"
        )
    parallelize_module(model, tp_mesh, plan_of())
    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not all(isinstance(p, DTensor) for p in own):
            _replicate(module, tp_mesh)


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """The module's own parameters become replicated DTensors; it keeps taking and
    returning plain tensors, as its neighbours in the model expect."""

    def params_only(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
        if sub is not module:
            return  # children are parallelized (or replicated) on their own
        for pname, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                replicated = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
                sub.register_parameter(pname, nn.Parameter(replicated, p.requires_grad))

    def inputs_to_dtensor(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def outputs_to_local(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    distribute_module(module, mesh, params_only, inputs_to_dtensor, outputs_to_local)


class TensorParallelStrategy(DataParallelStrategy):
    """`strategy.kind: tp`: tensor-parallel groups of `strategy.tensor_parallel` ranks,
    data-parallel across groups."""

    def make_layout(self, ctx: TrainContext, spec: JobSpec) -> Layout:
        return grid_layout(ctx.rank, ctx.world_size, tp=spec.strategy.tensor_parallel_degree)

    def wrap(self, model: nn.Module, mixed_precision: torch.dtype | None) -> nn.Module:
        self.autocast_dtype = mixed_precision  # parameters stay fp32, as with DDP
        mesh = grid_mesh(self.device.type, self.layout)
        parallelize(model, mesh["tp"])
        self.norm_group = mesh["tp"].get_group()
        self._dp_group = mesh["dp"].get_group() if self.layout.dp > 1 else None
        # Replicas start identical without a broadcast: every rank built the same model
        # from the same seed (the loop's), and the plan slices it the same way.
        return model

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        yield
        if enabled and self._dp_group is not None:
            # Every replica reduces the same buckets: a parameter without a gradient (an
            # unused branch) takes part with zeros.
            for p in self.model.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            all_reduce_scaled(grads, 1.0 / self.layout.dp, self._dp_group)
