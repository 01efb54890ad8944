"""`training.compile`: `torch.compile` per block, as torchtitan compiles a transformer.

Each of `model.shard_units()` (the gpt's and a Hugging Face model's decoder layers) has its
`forward` compiled on its own (in place on the instance, so parameter names, and so
checkpoints, do not change) rather than the whole model: the blocks share one
code object, so one compiled graph serves them all, and compilation stays inside the
units the strategies already wrap (FSDP2 shards each unit; DDP and tensor parallel see
plain modules). Applied after activation checkpointing and before the strategy wraps the
model, torchtitan's order.

Compilation is lazy, at a process's first step. Dynamo keeps the compiled code in the
process, keyed by the blocks' code and guarded on shapes, not on the module objects, so
a later attempt in the same warm process (a recovery at the same shapes) builds a new
model and runs it compiled at once; inductor's on-disk cache also spares a fresh process
most of the work.
"""

from __future__ import annotations

import torch
from torch import nn

from elastrain.workers.activation import model_units


def compile_units(model: nn.Module) -> int:
    """Compile each of the model's units in place; returns how many."""
    units = model_units(model, "training.compile")
    for unit in units:
        # The forward, not the module's whole call (`nn.Module.compile`): the hooks the
        # strategies put on a unit (FSDP2's all-gather and reshard) then run as they are,
        # outside the graph, instead of breaking it at every block.
        unit.forward = torch.compile(unit.forward)
    return len(units)


def is_compile_error(exc: BaseException) -> bool:
    """An error of torch.compile itself (dynamo tracing, inductor's code generation), not
    of the model's code."""
    module = type(exc).__module__
    return module.startswith(("torch._dynamo", "torch._inductor"))
