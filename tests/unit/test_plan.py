"""The memory plan: its model of the workloads against the real ones, and its choices."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.plan import ORDER, gpt_shape, plan, shape_of, synthetic_shape
from contracts.spec import ActivationCheckpointing, JobSpec, StrategyKind
from contracts.workload_params import GptParams, SyntheticParams
from workers.activation import ActivationMeter, apply_activation_checkpointing
from workers.workloads.gpt import build as build_gpt
from workers.workloads.synthetic import build as build_synthetic

GIB = 2**30


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32},
        {"n_layer": 6, "n_embd": 96, "n_head": 4, "seq_len": 128},
    ],
)
def test_the_gpt_shape_counts_the_real_parameters(params: dict[str, Any]) -> None:
    model = build_gpt(**params).model
    shape = gpt_shape(GptParams.model_validate(params))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.unit_params == sum(p.numel() for p in model.blocks["0"].parameters())


def test_the_synthetic_shape_counts_the_real_parameters() -> None:
    model = build_synthetic(hidden=48, n_layer=3).model
    shape = synthetic_shape(SyntheticParams(hidden=48, n_layer=3))
    assert shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode", list(ActivationCheckpointing))
@pytest.mark.parametrize(
    "params",
    [
        {"n_layer": 4, "n_embd": 32, "n_head": 2, "seq_len": 32},
        {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64},
    ],
)
def test_the_activation_estimate_is_within_a_fifth_of_the_measured(
    params: dict[str, Any], mode: ActivationCheckpointing
) -> None:
    torch.manual_seed(0)
    workload = build_gpt(**params)
    meter = ActivationMeter()
    apply_activation_checkpointing(workload.model, mode, meter)
    x = torch.stack([workload.dataset[i][0] for i in range(4)])
    y = torch.stack([workload.dataset[i][1] for i in range(4)])
    with meter.measuring():
        loss = workload.loss_fn(workload.model(x), y)
    loss.backward()
    estimate = gpt_shape(GptParams.model_validate(params)).activations[mode] * 4
    assert estimate == pytest.approx(meter.peak, rel=0.2), (estimate, meter.peak)


def _spec(params: dict[str, Any], **training: Any) -> JobSpec:
    training = {"activation_checkpointing": "full", **training}
    return JobSpec.model_validate(
        {
            "name": "plan",
            "workload": {"name": "gpt", "params": params},
            "scaling": {"min_workers": 1, "max_workers": 8},
            "training": {"global_batch_size": 32, "micro_batch_size": 4, **training},
        }
    )


# ~1.2B parameters: 12·d²·L with d=2048, L=24 (the gpt's own shape, a big vocabulary).
BIG = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 1024}


@pytest.mark.parametrize(
    ("params", "world_size", "device_gib", "choice", "words"),
    [
        pytest.param({}, 2, 16, StrategyKind.ddp, "ddp:", id="small-model-ddp"),
        # 20 bytes a parameter (24 GiB) do not fit 16 GiB; sharded over 8 they do.
        pytest.param(BIG, 8, 16, StrategyKind.fsdp, "ddp needs", id="optimizer-state-fsdp"),
        # Alone, nothing shards it: 16 bytes a parameter on one worker.
        pytest.param(BIG, 1, 16, None, "nothing fits", id="one-worker-nothing-fits"),
        # A block wider than a device: only tensor parallelism would do.
        pytest.param(
            {"n_layer": 2, "n_embd": 16384, "n_head": 16, "seq_len": 8}, 8, 16, None,
            "tensor parallelism", id="a-block-does-not-fit",
        ),
    ],
)  # fmt: skip
def test_plan_choices(
    params: dict[str, Any],
    world_size: int,
    device_gib: int,
    choice: StrategyKind | None,
    words: str,
) -> None:
    spec = _spec(params)
    shape = shape_of(spec)
    assert shape is not None
    result = plan(shape, spec, world_size, device_gib * GIB)
    assert result.choice == choice, result.why
    assert words in result.why
    assert [r.strategy for r in result.rows] == list(ORDER)
    fsdp = next(r for r in result.rows if r.strategy is StrategyKind.fsdp)
    ddp = next(r for r in result.rows if r.strategy is StrategyKind.ddp)
    assert fsdp.total <= ddp.total  # sharding never costs a rank more


def test_activation_checkpointing_can_make_ddp_fit() -> None:
    params = {"n_layer": 8, "n_embd": 256, "n_head": 4, "seq_len": 2048}
    device = 2 * GIB
    plain = _spec(
        params, micro_batch_size=32, global_batch_size=64, activation_checkpointing="none"
    )
    full = _spec(params, micro_batch_size=32, global_batch_size=64, activation_checkpointing="full")
    shape = shape_of(plain)
    assert shape is not None
    assert plan(shape, plain, 2, device).choice is not StrategyKind.ddp
    assert plan(shape, full, 2, device).choice is StrategyKind.ddp


def test_custom_workloads_have_no_shape() -> None:
    spec = JobSpec.model_validate({"name": "x", "workload": {"entrypoint": "m:f"}})
    assert shape_of(spec) is None
