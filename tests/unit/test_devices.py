"""Which device a worker process trains on and which GPU it owns (`elastrain.workers.devices`)."""

from __future__ import annotations

import pytest
import torch

from elastrain.workers.devices import rank_device, to_host, visible_devices_for


@pytest.mark.parametrize(
    ("gpu", "inherited", "expected"),
    [
        (None, None, ""),  # a CPU process sees no GPU
        (None, "0,1", ""),
        (0, None, "0"),
        (1, "", "1"),
        (1, "4,5", "5"),  # the raylet sees GPUs 4 and 5: Ray's index 1 is device 5
        (0, "GPU-3a1f,GPU-77b2", "GPU-3a1f"),  # UUIDs pass through
    ],
)
def test_visible_devices_for(gpu: int | None, inherited: str | None, expected: str) -> None:
    assert visible_devices_for(gpu, inherited) == expected


def test_an_index_past_the_nodes_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=4,5"):
        visible_devices_for(2, "4,5")


@pytest.mark.parametrize(
    ("use_gpu", "env", "expected"),
    [
        (False, {}, ("cpu", "gloo")),
        (True, {}, ("cuda:0", "nccl")),
        (True, {"ELASTRAIN_TEST_GPU_ON_CPU": "1"}, ("cpu", "gloo")),
        (True, {"ELASTRAIN_TEST_GPU_ON_CPU": "0"}, ("cuda:0", "nccl")),
        (False, {"ELASTRAIN_TEST_GPU_ON_CPU": "1"}, ("cpu", "gloo")),
    ],
)
def test_rank_device(use_gpu: bool, env: dict[str, str], expected: tuple[str, str]) -> None:
    assert rank_device(use_gpu, env=env) == expected


def test_to_host_keeps_the_nesting_and_host_tensors() -> None:
    t = torch.ones(2)
    state = {"model": {"w": t}, "optim": [t, (t, 3)], "step": 4}
    out = to_host(state)
    assert out["model"]["w"] is t  # already on the host: not copied
    assert isinstance(out["optim"][1], tuple) and out["optim"][1][1] == 3
    assert out["step"] == 4
