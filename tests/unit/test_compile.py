"""`training.compile` on gloo (CPU, inductor): per-block torch.compile composed with DDP,
FSDP2 (with activation checkpointing) and tensor parallel follows the eager loss curve
within 1e-3 relative over 50 steps; a second attempt in the same process compiles nothing
again; jobs that cannot compile are refused with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.compiling import compile_units
from elastrain.workers.workloads import WorkloadError
from tests.unit.dist_utils import run_distributed
from tests.unit.hooks import RecordingHooks

STEPS = 50


def gpt_spec(strategy: dict[str, Any], *, compile: bool, checkpointing: str = "none") -> JobSpec:
    return JobSpec(
        name="c",
        workload={
            "name": "gpt",
            "params": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16},
        },
        strategy=strategy,
        training={
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "max_steps": STEPS,
            "learning_rate": 3e-3,
            "seed": 3,
            "compile": compile,
            "activation_checkpointing": checkpointing,
        },
        checkpoint={"every_steps": 1000, "async_save": False},
    )


def run_jobs(rank: int, world_size: int, root: str) -> Any:
    from torch._dynamo.utils import counters

    from elastrain.workers.loop import train

    jobs = {
        "ddp": ({"kind": "ddp"}, "none"),
        "fsdp": ({"kind": "fsdp"}, "full"),
        "tp": ({"kind": "tp", "tensor_parallel": 2}, "none"),
    }
    out: dict[str, Any] = {}
    for label, (strategy, checkpointing) in jobs.items():
        for compiled in (False, True):
            spec = gpt_spec(strategy, compile=compiled, checkpointing=checkpointing)
            hooks = RecordingHooks()
            ctx = TrainContext(
                rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                job_id=1, attempt=1, checkpoint_root=Path(root) / f"{label}-{compiled}",
            )  # fmt: skip
            train(ctx, spec, hooks)
            out[f"{label}-{'compiled' if compiled else 'eager'}"] = [m.loss for m in hooks.metrics]
    # The next attempt of a job in this warm process: a new model, the same shapes.
    graphs = counters["stats"]["unique_graphs"]
    spec = gpt_spec(jobs["ddp"][0], compile=True)
    ctx = TrainContext(
        rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
        job_id=1, attempt=2, checkpoint_root=Path(root) / "again",
    )  # fmt: skip
    train(ctx, spec, RecordingHooks())
    out["graphs compiled again"] = counters["stats"]["unique_graphs"] - graphs
    out["graphs"] = graphs
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("compile")
    result: dict[str, Any] = run_distributed(run_jobs, 2, str(root), timeout_s=1200)[0]
    return result


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "tp"])
def test_compiled_blocks_follow_the_eager_curve(curves: dict[str, Any], kind: str) -> None:
    eager, compiled = curves[f"{kind}-eager"], curves[f"{kind}-compiled"]
    assert len(eager) == len(compiled) == STEPS
    assert compiled[-1] < compiled[0] * 0.8  # it trains
    for a, b in zip(eager, compiled, strict=True):
        assert b == pytest.approx(a, rel=1e-3)


def test_a_later_attempt_in_the_warm_process_compiles_nothing_again(
    curves: dict[str, Any],
) -> None:
    assert curves["graphs"] > 0  # the blocks really were compiled
    assert curves["graphs compiled again"] == 0


def test_a_model_without_blocks_is_a_reason_not_a_crash() -> None:
    with pytest.raises(WorkloadError, match=r"training.compile .* no shard_units\(\)"):
        compile_units(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"strategy": {"kind": "pipeline", "pipeline_stages": 2}}, "training.compile"),
        ({"workload": {"command": ["python", "-c", "pass"]}}, "training.compile"),
    ],
)
def test_compile_where_it_cannot_apply_is_refused_at_submit(
    change: dict[str, Any], field: str
) -> None:
    raw = gpt_spec({"kind": "ddp"}, compile=True).model_dump(mode="json", exclude_none=True)
    with pytest.raises(ValidationError, match=field):
        JobSpec.model_validate({**raw, **change})


def test_a_block_that_does_not_compile_fails_its_first_step_naming_the_switch() -> None:
    from torch._dynamo.exc import InternalTorchDynamoError

    from elastrain.workers.errors import configuration_errors

    with (
        pytest.raises(
            WorkloadError,
            match=r"^training.compile: .* did not compile \(InternalTorchDynamoError: boom\); set",
        ),
        configuration_errors("workload: the job's first training step"),
    ):
        raise InternalTorchDynamoError("boom\n(the rest of dynamo's message)")
