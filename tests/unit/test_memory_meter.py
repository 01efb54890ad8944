"""Memory figures are measured on an attempt's first step and then every few seconds; the
steps between carry the latest figures, and the activation meter's hooks run only on the
steps measured (they cost every saved tensor a call)."""

from __future__ import annotations

import torch

from elastrain.workers.activation import ActivationMeter
from elastrain.workers.step_metrics import MemoryMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Strategy:
    def __init__(self) -> None:
        self.activations = ActivationMeter()
        self.measured = 0

    def memory_bytes(self) -> dict[str, int]:
        self.measured += 1
        return {"param_bytes": 10, "activation_bytes": self.activations.peak}


def forward(meter: ActivationMeter) -> None:
    """A micro-batch's forward: autograd saves x (4 x 4 floats) for the backward of x * x."""
    with meter.measuring():
        x = torch.ones(4, 4, requires_grad=True) + 0
        (x * x).sum()


def test_measured_on_the_first_step_then_every_interval_with_the_latest_between() -> None:
    strategy, clock = Strategy(), Clock()
    meter = MemoryMeter(strategy, every_s=2.0, clock=clock)  # type: ignore[arg-type]
    figures = []
    armed = []
    for _ in range(6):  # six steps of 0.5 s
        meter.start_step()
        armed.append(strategy.activations.armed)
        forward(strategy.activations)
        figures.append(meter.read())
        clock.now += 0.5
    assert armed == [True, False, False, False, True, False]
    assert strategy.measured == 2
    assert figures[1] is figures[0] and figures[5] is figures[4]
    # The measured steps saw the forward's activations; unarmed steps counted nothing.
    assert figures[0]["activation_bytes"] == figures[4]["activation_bytes"] == 64
    assert strategy.activations.peak == 0  # reset after the measured step, nothing since


def test_an_unarmed_activation_meter_counts_nothing() -> None:
    meter = ActivationMeter()
    meter.armed = False
    forward(meter)
    assert meter.peak == 0
    meter.armed = True
    forward(meter)
    assert meter.peak == 64
