"""The memory plan: its model of the workloads against the real ones, and its choices."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastrain.contracts.plan import (
    ORDER,
    choose_for_auto,
    gpt_shape,
    plan,
    shape_of,
    synthetic_shape,
)
from elastrain.contracts.spec import ActivationCheckpointing, JobSpec, StrategyKind
from elastrain.contracts.workload_params import GptParams, SyntheticParams
from elastrain.workers.activation import ActivationMeter, apply_activation_checkpointing
from elastrain.workers.workloads.gpt import build as build_gpt
from elastrain.workers.workloads.synthetic import build as build_synthetic

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
    model = build_gpt(GptParams.model_validate(params)).model
    shape = gpt_shape(GptParams.model_validate(params))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.unit_params == sum(p.numel() for p in model.blocks["0"].parameters())


def test_the_synthetic_shape_counts_the_real_parameters() -> None:
    model = build_synthetic(SyntheticParams(hidden=48, n_layer=3)).model
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
    workload = build_gpt(GptParams.model_validate(params))
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


WIDE = {"n_layer": 4, "n_embd": 8192, "n_head": 16, "seq_len": 8}


@pytest.mark.parametrize(
    ("params", "world_size", "device_gib", "choice", "words"),
    [
        pytest.param({}, 2, 16, "ddp", "ddp:", id="small-model-ddp"),
        # 20 bytes a parameter (24 GiB) do not fit 16 GiB; sharded over 8 they do.
        pytest.param(BIG, 8, 16, "fsdp", "ddp needs", id="optimizer-state-fsdp"),
        # Alone, nothing shards it: 16 bytes a parameter on one worker.
        pytest.param(BIG, 1, 16, None, "nothing fits", id="one-worker-nothing-fits"),
        # A block's gathered working set (12 bytes x 805M) does not fit beside FSDP's
        # shards: split every layer over 4 ranks, and shard those over the rest.
        pytest.param(WIDE, 4, 16, "fsdp+tp4", "fsdp needs", id="a-layer-does-not-fit-tp"),
        pytest.param(WIDE, 8, 16, "fsdp+tp2", "fsdp needs", id="more-ranks-less-tp"),
        # One worker: nothing can split the layer.
        pytest.param(
            {"n_layer": 2, "n_embd": 16384, "n_head": 16, "seq_len": 8}, 1, 16, None,
            "tensor parallelism cannot split it", id="a-block-does-not-fit-one-worker",
        ),
    ],
)  # fmt: skip
def test_plan_choices(
    params: dict[str, Any],
    world_size: int,
    device_gib: int,
    choice: str | None,
    words: str,
) -> None:
    spec = _spec(params)
    shape = shape_of(spec)
    assert shape is not None
    result = plan(shape, spec, world_size, device_gib * GIB)
    assert (result.chosen.label if result.chosen else None) == choice, result.why
    assert words in result.why
    assert [r.strategy for r in result.rows[:3]] == list(ORDER)
    by_label = {r.label: r for r in result.rows}
    assert by_label["fsdp"].total <= by_label["ddp"].total  # sharding never costs a rank more
    for r in result.rows:
        if r.tensor_parallel > 1 and r.total:
            # Splitting layers never costs a rank more than the same strategy unsplit.
            assert (
                r.total <= by_label[r.strategy.value if r.strategy.value != "tp" else "ddp"].total
            )


def test_tensor_parallel_rows_follow_the_degrees_that_divide() -> None:
    spec = _spec({"n_layer": 4, "n_embd": 96, "n_head": 6})  # 6 heads: degree 2 only
    shape = shape_of(spec)
    assert shape is not None
    assert [r.label for r in plan(shape, spec, 4, GIB).rows] == [
        "ddp", "fsdp", "pipeline", "tp2", "fsdp+tp2", "pipeline+tp2",
    ]  # fmt: skip
    assert [r.label for r in plan(shape, spec, 3, GIB).rows] == ["ddp", "fsdp", "pipeline"]
    synthetic = JobSpec.model_validate({"name": "s", "workload": {"name": "synthetic"}})
    shape = shape_of(synthetic)
    assert shape is not None
    assert len(plan(shape, synthetic, 4, GIB).rows) == 3  # no tensor-parallel plan


def test_auto_picks_tensor_parallel_only_where_sharding_is_not_enough() -> None:
    spec = _spec(WIDE)
    spec = spec.model_copy(update={"strategy": spec.strategy.model_copy(update={"kind": "auto"})})
    assert choose_for_auto(spec, 8, 64 * GIB).label == "fsdp"
    assert choose_for_auto(spec, 4, 16 * GIB).label == "fsdp+tp4"
    # Three workers cannot split 16 heads; the least memory is chosen and the reason said.
    three = choose_for_auto(spec, 3, 16 * GIB)
    assert three.label == "fsdp" and "least memory" in three.why


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


def test_cpu_offload_leaves_the_device_only_the_units_in_flight() -> None:
    body = _spec(BIG).model_dump()
    body["strategy"] = {"kind": "fsdp", "cpu_offload": True}
    body["scaling"] = {"min_workers": 1, "max_workers": 8, "use_gpu": True, "gpus_per_worker": 1}
    offload = JobSpec.model_validate(body)
    shape = shape_of(offload)
    assert shape is not None
    fsdp = plan(shape, offload, 1, 16 * GIB).rows[1]
    assert (fsdp.label, fsdp.optimizer) == ("fsdp", 0)
    assert fsdp.params == 8 * shape.unit_params and fsdp.fits  # one worker is enough now
    assert "offloaded to host memory" in fsdp.note
    body["strategy"] = {"kind": "fsdp"}
    plain = plan(shape, JobSpec.model_validate(body), 1, 16 * GIB).rows[1]
    assert not plain.fits and plain.total > 10 * fsdp.total
