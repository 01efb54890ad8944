"""A tiny deterministic regression task for tests and smoke runs.

Inputs are Gaussian vectors drawn from a fixed seed; targets come from a fixed random
"teacher" function (linear plus a sine), so the data set is the same in every process and
on every run, and a small MLP fits it quickly (the loss halves within a few steps).

The model mirrors the GPT workload's structure: an input layer, residual Linear+ReLU
blocks in an `nn.ModuleDict` keyed by index, and a head. That gives FSDP per-block
`shard_units()` and a `pipeline_stage()` that keeps parameter names unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastrain.contracts.workload_params import SyntheticParams
from elastrain.workers.api import Workload
from elastrain.workers.workloads import stage_block_range


class SyntheticRegression:
    """`num_samples` pairs (x in R^in_dim, y in R^out_dim), generated once, held in memory."""

    def __init__(self, *, num_samples: int, in_dim: int, out_dim: int, data_seed: int) -> None:
        gen = torch.Generator().manual_seed(data_seed)
        self.x = torch.randn(num_samples, in_dim, generator=gen)
        # A mostly linear teacher with a nonlinear wiggle: learnable within a few steps
        # (tests see the loss fall), but not trivially by the first layer alone.
        linear = torch.randn(in_dim, out_dim, generator=gen) / in_dim**0.5
        wiggle = torch.randn(in_dim, out_dim, generator=gen) / in_dim**0.5
        noise = 0.01 * torch.randn(num_samples, out_dim, generator=gen)
        self.y = self.x @ linear + 0.3 * torch.sin(3.0 * self.x @ wiggle) + noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class MLPModel(nn.Module):
    """`inp` -> blocks "0".."n-1" -> `head`; `inp`/`head` are None in middle pipeline stages."""

    def __init__(self, *, in_dim: int, hidden: int, out_dim: int, n_layer: int) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.inp: nn.Linear | None = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleDict({str(i): ResidualBlock(hidden) for i in range(n_layer)})
        self.head: nn.Linear | None = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks.values())

    def pipeline_stage(self, stage_index: int, num_stages: int) -> MLPModel:
        """Stage `stage_index`'s part; shares sub-modules with `self` (use it instead)."""
        lo, hi = stage_block_range(self.n_layer, stage_index, num_stages)
        stage = MLPModel.__new__(MLPModel)
        nn.Module.__init__(stage)
        stage.n_layer = self.n_layer
        stage.inp = self.inp if stage_index == 0 else None
        stage.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in range(lo, hi)})
        stage.head = self.head if stage_index == num_stages - 1 else None
        return stage


def build(params: SyntheticParams) -> Workload:
    """The built-in `synthetic` workload (MSE regression, ~17k parameters by default).

    `data_seed` fixes the data set independently of the job seed, which seeds the model
    initialisation and the sample order.
    """
    model = MLPModel(
        in_dim=params.in_dim, hidden=params.hidden, out_dim=params.out_dim, n_layer=params.n_layer
    )
    n_params = sum(p.numel() for p in model.parameters())
    return Workload(
        model=model,
        dataset=SyntheticRegression(
            num_samples=params.num_samples,
            in_dim=params.in_dim,
            out_dim=params.out_dim,
            data_seed=params.data_seed,
        ),
        loss_fn=F.mse_loss,
        flops_per_sample=6.0 * n_params,
    )
