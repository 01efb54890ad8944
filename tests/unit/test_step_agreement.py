"""The step agreement (global loss, rank 0's control) rides a collective the step makes
anyway where one sums over every rank, and goes on its own elsewhere; either way every rank
gets the same sum, and carrying it changes no gradient.

One spawn of 2 gloo ranks runs every case: for each, one step with an agreement and the
same step on a second, identically built strategy without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from contracts.messages import Control
from contracts.spec import JobSpec
from tests.unit.dist_utils import run_distributed
from workers.agreement import StepAgreement
from workers.api import TrainContext

PIPELINE = {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 2}
#: label -> (strategy, grad_clip, the agreement rides a collective of the step)
CASES: dict[str, tuple[dict[str, Any], float | None, bool]] = {
    "ddp": ({"kind": "ddp"}, 1.0, True),  # DDP's first gradient bucket
    "ddp, no clipping": ({"kind": "ddp"}, None, True),
    "fsdp": ({"kind": "fsdp"}, 1.0, True),  # the clipping's squared-norm all-reduce
    "fsdp, no clipping": ({"kind": "fsdp"}, None, False),
    "pipeline": (PIPELINE, 1.0, True),  # the clipping's all-reduce over the stages
    "pipeline, no clipping": (PIPELINE, None, False),
}


def _spec(strategy: dict[str, Any], grad_clip: float | None) -> JobSpec:
    return JobSpec(
        name="agree",
        workload={
            "name": "gpt",
            "params": {"n_layer": 2, "n_embd": 16, "n_head": 2, "seq_len": 16},
        },
        strategy=strategy,
        training={
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 1,
            "learning_rate": 1e-2,
            "grad_clip": grad_clip,
        },
    )


def _one_step(rank: int, world: int, spec: JobSpec, agree: bool) -> dict[str, Any]:
    from workers.loop import Collator, seed_everything
    from workers.sampler import ElasticSampler
    from workers.strategies import make_strategy
    from workers.workloads import load_workload

    seed_everything(spec.training.seed)
    workload = load_workload(spec.workload)
    strategy = make_strategy(spec.strategy.kind)
    ctx = TrainContext(
        rank=rank,
        world_size=world,
        local_rank=rank,
        device=torch.device("cpu"),
        job_id=1,
        attempt=1,
        checkpoint_root=Path("unused"),
    )
    strategy.setup(workload, ctx, spec)
    layout = strategy.layout
    training = spec.training
    sampler = ElasticSampler(len(workload.dataset), training.global_batch_size, 0)
    collate = Collator(workload.dataset)
    ids = sampler.microbatches(0, layout.dp_rank, layout.dp, training.micro_batch_size)
    batches = [collate(mb) for mb in ids]
    loss_scale = layout.dp / training.global_batch_size
    out: dict[str, Any] = {}
    if agree:
        agreement = StepAgreement(Control.STOP if rank == 0 else Control.NONE)
        step = strategy.forward_backward(batches, loss_scale, agreement)
        strategy.prepare_update(agreement)
        alone = agreement.sent_alone
        out["loss"], out["control"] = agreement.wait()
        out["alone"] = alone
        expected = step.loss.double().clone()
        dist.all_reduce(expected)
        out["expected_loss"] = float(expected)
        strategy.apply_update()
    else:
        strategy.train_step(batches, loss_scale)
    out["params"] = [
        getattr(p, "_local_tensor", p).detach().clone() for p in strategy.model.parameters()
    ]
    return out


def run_cases(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for label, (strategy, grad_clip, _) in CASES.items():
        spec = _spec(strategy, grad_clip)
        results[label] = {
            "with": _one_step(rank, world, spec, agree=True),
            "without": _one_step(rank, world, spec, agree=False),
        }
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, timeout_s=600)


@pytest.mark.parametrize("label", list(CASES))
def test_every_rank_agrees_on_the_global_loss_and_rank_0s_control(
    ranks: list[dict[str, Any]], label: str
) -> None:
    for rank in ranks:
        got = rank[label]["with"]
        assert got["control"] is Control.STOP  # rank 0's, on both ranks
        assert got["loss"] == pytest.approx(got["expected_loss"], rel=1e-6)
        assert got["loss"] > 0
    assert ranks[0][label]["with"]["loss"] == ranks[1][label]["with"]["loss"]


@pytest.mark.parametrize("label", list(CASES))
def test_the_agreement_rides_a_collective_of_the_step_where_one_spans_every_rank(
    ranks: list[dict[str, Any]], label: str
) -> None:
    carried = CASES[label][2]
    assert [r[label]["with"]["alone"] for r in ranks] == [not carried] * 2


@pytest.mark.parametrize("label", list(CASES))
def test_carrying_the_agreement_changes_no_weight(ranks: list[dict[str, Any]], label: str) -> None:
    for rank in ranks:
        with_, without = rank[label]["with"]["params"], rank[label]["without"]["params"]
        assert len(with_) == len(without)
        for a, b in zip(with_, without, strict=True):
            assert torch.equal(a, b)
