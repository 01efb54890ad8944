"""Batches go to the rank's device without a stall (`workers.strategies.base.to_device`).
The pinned, non-blocking copy itself needs a GPU: `make gpu-check` exercises it."""

from __future__ import annotations

import torch

from elastrain.workers.strategies.base import to_device


def test_a_batch_already_on_its_device_is_not_copied() -> None:
    batch = torch.arange(8)
    assert to_device(batch, torch.device("cpu")) is batch


def test_a_batch_for_another_non_cuda_device_is_copied_plainly() -> None:
    batch = torch.arange(8)
    moved = to_device(batch, torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == batch.shape
