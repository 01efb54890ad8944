"""Activation checkpointing: the same losses, less activation memory (gloo, CPU, 2 ranks).

Recomputing a block in backward runs the same float operations on the same inputs, so the
losses are equal, not merely close; the metric `memory.activation_bytes` (what one
micro-batch's forward keeps for backward) must fall: full < selective < none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastrain.contracts.spec import JobSpec
from tests.unit.dist_utils import run_distributed
from tests.unit.test_workers_train import run_jobs

STEPS = 3
MODES = ("none", "selective", "full")


def gpt_spec(kind: str, mode: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": f"ac-{kind}-{mode}",
            "workload": {
                "name": "gpt",
                "params": {"n_layer": 4, "n_embd": 32, "n_head": 2, "seq_len": 32},
            },
            "strategy": {"kind": kind, **({"pipeline_stages": 2} if kind == "pipeline" else {})},
            "scaling": {"min_workers": 1, "max_workers": 2},
            "training": {
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "max_steps": STEPS,
                "activation_checkpointing": mode,
                "seed": 3,
            },
            "checkpoint": {"every_steps": 100, "async_save": False},
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ac")
    jobs = [
        (f"{kind}-{mode}", str(root / f"{kind}-{mode}"), gpt_spec(kind, mode), [])
        for kind in ("ddp", "fsdp", "pipeline")
        for mode in MODES
    ]
    out: dict[str, Any] = run_distributed(run_jobs, 2, jobs, timeout_s=600)[0]
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "pipeline"])
def test_same_losses_less_activation_memory(runs: dict[str, Any], kind: str) -> None:
    losses = {m: [p.loss for p in runs[f"{kind}-{m}"]["metrics"]] for m in MODES}
    assert losses["full"] == losses["selective"] == losses["none"], losses
    kept = {m: runs[f"{kind}-{m}"]["metrics"][-1].memory["activation_bytes"] for m in MODES}
    assert 0 < kept["full"] < kept["selective"] < kept["none"], kept


def test_a_model_without_units_is_refused(tmp_path: Path) -> None:
    from torch import nn

    from elastrain.contracts.spec import ActivationCheckpointing
    from elastrain.workers.activation import ActivationMeter, apply_activation_checkpointing

    with pytest.raises(ValueError, match="shard_units"):
        apply_activation_checkpointing(
            nn.Linear(2, 2), ActivationCheckpointing.full, ActivationMeter()
        )
