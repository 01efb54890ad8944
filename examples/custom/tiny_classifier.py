"""An example custom workload: a factory returning model, data set and loss.

Submit it with its folder: `elastrain submit examples/custom.yaml --working-dir
examples/custom` (entrypoint "tiny_classifier:make_workload"). The folder is uploaded once,
stored by its content, and importable on every worker of every attempt.
"""

from __future__ import annotations

import torch
from torch import nn

from elastrain.workers.api import Workload


class TwoMoons(torch.utils.data.Dataset):
    """Two interleaved half-circles with noise: generated from a seed, nothing downloaded."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        t = torch.rand(n, generator=gen) * torch.pi
        label = torch.randint(0, 2, (n,), generator=gen)
        x = torch.stack([torch.cos(t), torch.sin(t)], dim=1)
        x[label == 1] = torch.stack([1 - torch.cos(t), 0.5 - torch.sin(t)], dim=1)[label == 1]
        self.x = x + 0.1 * torch.randn(n, 2, generator=gen)
        self.y = label

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_workload(hidden: int = 64, n: int = 4096, seed: int = 0) -> Workload:
    model = nn.Sequential(
        nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2)
    )
    return Workload(model=model, dataset=TwoMoons(n, seed), loss_fn=nn.functional.cross_entropy)
