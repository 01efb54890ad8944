"""The step agreement (global loss, rank 0's control) rides a collective the step makes
anyway where one sums over every rank, and goes on its own elsewhere; either way every rank
gets the same sum, the loss of the global batch, and riding changes no weight.

One spawn of 2 gloo ranks runs every case: for each, `Strategy.step` (what the loop calls)
once with the agreement riding the step's collectives and once, on a second identically
built strategy, with it forced onto an all-reduce of its own. The loss is checked against
the global batch's loss computed here, in one process, on the same initial model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain.contracts.messages import Control
from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from tests.unit.dist_utils import run_distributed

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
SAMPLER_SEED = 0


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


def _one_step(rank: int, world: int, spec: JobSpec, rides: bool) -> dict[str, Any]:
    from elastrain.workers.agreement import StepAgreement
    from elastrain.workers.loop import Collator
    from elastrain.workers.rng import seed_everything
    from elastrain.workers.sampler import ElasticSampler
    from elastrain.workers.strategies import make_strategy
    from elastrain.workers.workloads import load_workload

    seed_everything(spec.training.seed)
    workload = load_workload(spec.workload)
    strategy = make_strategy(spec.strategy.kind)
    strategy.agreement_rides_collectives = rides
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
    sampler = ElasticSampler(len(workload.dataset), training.global_batch_size, SAMPLER_SEED)
    collate = Collator(workload.dataset)
    ids = sampler.microbatches(0, layout.dp_rank, layout.dp, training.micro_batch_size)

    # Whether the step's agreement took an all-reduce of its own (seen as it is waited for).
    alone: list[bool] = []
    wait = StepAgreement.wait

    def watched_wait(agreement: StepAgreement) -> tuple[float, Control]:
        agreed = wait(agreement)
        alone.append(agreement.sent_alone)
        return agreed

    StepAgreement.wait = watched_wait  # type: ignore[method-assign, assignment]
    try:
        result = strategy.step(
            [collate(mb) for mb in ids],
            loss_scale=layout.dp / training.global_batch_size,
            lr=training.learning_rate,
            control=Control.STOP if rank == 0 else Control.NONE,
        )
    finally:
        StepAgreement.wait = wait  # type: ignore[method-assign]
    return {
        "loss_sum": result.loss_sum,
        "control": result.control,
        "alone": alone,
        "params": [
            getattr(p, "_local_tensor", p).detach().clone() for p in strategy.model.parameters()
        ],
    }


def run_cases(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for label, (strategy, grad_clip, _) in CASES.items():
        spec = _spec(strategy, grad_clip)
        results[label] = {
            "rides": _one_step(rank, world, spec, rides=True),
            "alone": _one_step(rank, world, spec, rides=False),
        }
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, timeout_s=600)


def global_batch_loss_sum(spec: JobSpec) -> float:
    """The first global batch's summed per-sample loss, on the initial model, in one
    process: what the ranks must agree on."""
    from elastrain.workers.loop import Collator
    from elastrain.workers.rng import seed_everything
    from elastrain.workers.sampler import ElasticSampler
    from elastrain.workers.workloads import load_workload

    seed_everything(spec.training.seed)
    workload = load_workload(spec.workload)
    sampler = ElasticSampler(len(workload.dataset), spec.training.global_batch_size, SAMPLER_SEED)
    inputs, targets = Collator(workload.dataset)(sampler.global_batch(0))
    with torch.no_grad():
        return float(workload.loss_fn(workload.model(inputs), targets)) * len(inputs)


@pytest.mark.parametrize("label", list(CASES))
def test_every_rank_agrees_on_the_global_loss_and_rank_0s_control(
    ranks: list[dict[str, Any]], label: str
) -> None:
    expected = global_batch_loss_sum(_spec(*CASES[label][:2]))
    for rank in ranks:
        for way in ("rides", "alone"):
            got = rank[label][way]
            assert got["control"] is Control.STOP  # rank 0's, on both ranks
            assert got["loss_sum"] == pytest.approx(expected, rel=1e-5)
        # Carried in a float32 gradient bucket or norm, or alone in float64: the same sum.
        rides, alone = rank[label]["rides"]["loss_sum"], rank[label]["alone"]["loss_sum"]
        assert rides == pytest.approx(alone, rel=1e-6)
    for way in ("rides", "alone"):
        assert ranks[0][label][way]["loss_sum"] == ranks[1][label][way]["loss_sum"]


@pytest.mark.parametrize("label", list(CASES))
def test_the_agreement_rides_a_collective_of_the_step_where_one_spans_every_rank(
    ranks: list[dict[str, Any]], label: str
) -> None:
    carried = CASES[label][2]
    assert [r[label]["rides"]["alone"] for r in ranks] == [[not carried]] * 2
    assert [r[label]["alone"]["alone"] for r in ranks] == [[True]] * 2


@pytest.mark.parametrize("label", list(CASES))
def test_riding_a_collective_changes_no_weight(ranks: list[dict[str, Any]], label: str) -> None:
    for rank in ranks:
        rides, alone = rank[label]["rides"]["params"], rank[label]["alone"]["params"]
        assert len(rides) == len(alone)
        for a, b in zip(rides, alone, strict=True):
            assert torch.equal(a, b)
