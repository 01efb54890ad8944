"""PipelineStrategy: layout, gradients equal to a non-pipelined reference, loss falls,
and DCP checkpoints that reshard across replica counts and into the unsplit model.

Two spawns of gloo processes do the distributed work (module-scoped fixtures, since a spawn
costs seconds on two cores): 2 ranks (2 stages x 1 replica) and 4 ranks (2 stages x 2
replicas). Each returns plain tensors; the comparisons run here, against references
computed in this process on the full model.

Tolerance: the pipeline computes the same float32 sums in a different order (per
pipeline micro-batch, then across micro-batches and replicas, scaled after summing), so
results agree to a few ulps of the values involved: atol 1e-6 / rtol 1e-5 on gradients
of order 1e-2..1, and 1e-6 relative on the loss.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elastrain.contracts.spec import JobSpec, MixedPrecision
from elastrain.workers.api import TrainContext, Workload
from elastrain.workers.strategies.base import Layout
from elastrain.workers.strategies.pipeline import (
    CHECKPOINT_OPTIONS,
    PipelineStrategy,
    pipeline_chunks,
    pipeline_layout,
)
from elastrain.workers.workloads import WorkloadError
from tests.unit.dist_utils import run_distributed

VOCAB, DIM, SEQ, N_LAYER = 16, 8, 4, 4
LR = 1e-2
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5


# ---------------------------------------------------------------------------------------
# A tiny GPT-like model with the workload contract's `pipeline_stage`
# ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TinyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, VOCAB); `emb`/`head` are None in inner stages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Embedding | None = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block(DIM) for i in range(N_LAYER)})
        self.head: nn.Linear | None = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x

    def pipeline_stage(self, stage_index: int, num_stages: int) -> TinyLM:
        per = N_LAYER // num_stages
        stage = TinyLM.__new__(TinyLM)
        nn.Module.__init__(stage)
        stage.emb = self.emb if stage_index == 0 else None
        keys = range(stage_index * per, (stage_index + 1) * per)
        stage.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in keys})
        stage.head = self.head if stage_index == num_stages - 1 else None
        return stage


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: predict (3 * token + 1) mod VOCAB."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return x, (3 * x + 1) % VOCAB


def make_workload(seed: int) -> Workload:
    return Workload(model=make_model(seed), dataset=[], loss_fn=lm_loss)


def make_spec(schedule: str, microbatches: int, stages: int = 2) -> JobSpec:
    """A pipeline job spec; the strategy reads its `strategy` and `training` sections."""
    return JobSpec(
        name="pipeline-test",
        workload={"name": "synthetic"},
        strategy={
            "kind": "pipeline",
            "pipeline_stages": stages,
            "microbatches": microbatches,
            "schedule": schedule,
        },
        scaling={"min_workers": stages, "max_workers": max(4, stages)},
        training={"learning_rate": LR},
    )


def loop_share(
    x: torch.Tensor, y: torch.Tensor, dp_rank: int, shares: tuple[tuple[int, ...], ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the loop hands a rank of replica `dp_rank`: that replica's contiguous share of
    the global batch, cut into micro-batches of sizes `shares[dp_rank]` (0 = empty)."""
    pos = sum(sum(share) for share in shares[:dp_rank])
    out = []
    for n in shares[dp_rank]:
        out.append((x[pos : pos + n], y[pos : pos + n]))
        pos += n
    return out


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str
    microbatches: int  # the spec's strategy.microbatches
    shares: tuple[tuple[int, ...], ...]  # per replica: the loop's micro-batch sizes
    grad_clip: float | None = None
    stages: int = 2

    @property
    def global_batch(self) -> int:
        return sum(sum(share) for share in self.shares)


# 2 ranks = 1 replica.
PAIR_CASES = [
    Case("gpipe", "gpipe", 4, ((4, 4),)),  # 8 samples -> 4 pipeline micro-batches of 2
    Case("1f1b", "1f1b", 4, ((4, 4),)),
    Case("1f1b-accumulate", "1f1b", 2, ((2, 2, 2, 2),)),  # 2 schedule steps of 2 mbs
    Case("gpipe-uneven", "gpipe", 4, ((3, 3, 2),)),  # groups 3+3 (3 x 2) and 2 (2 x 1)
    Case("1f1b-clipped", "1f1b", 4, ((4, 4),), grad_clip=0.05),
]
# 4 ranks = 2 replicas; shares cut as `elastrain.workers.sampler` does (larger first, same count).
QUAD_CASES = [
    Case("gpipe", "gpipe", 4, ((4, 4), (4, 4))),
    Case("1f1b", "1f1b", 4, ((4, 4), (4, 4))),
    Case("1f1b-accumulate", "1f1b", 2, ((2, 2, 2, 2), (2, 2, 2, 2))),
    Case("1f1b-uneven-shares", "1f1b", 4, ((3, 2), (2, 2))),  # G = 9
    Case("gpipe-empty-share", "gpipe", 4, ((1,), (0,))),  # G = 1: replica 1 gets nothing
    Case("1f1b-clipped", "1f1b", 4, ((4, 4), (4, 4)), grad_clip=0.05),
    Case("1f1b-4-stages", "1f1b", 4, ((4, 4),), stages=4),  # two middle stages
    Case("1-stage-4-replicas", "1f1b", 4, ((2, 2),) * 4, stages=1),
]


def _ctx(rank: int, world_size: int, root: str) -> TrainContext:
    return TrainContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        device=torch.device("cpu"),
        job_id=1,
        attempt=1,
        checkpoint_root=Path(root),
    )


def _run_case(rank: int, world_size: int, case: Case, root: str) -> dict[str, Any]:
    strategy = PipelineStrategy(grad_clip=case.grad_clip)
    strategy.setup(
        make_workload(seed=0),
        _ctx(rank, world_size, root),
        make_spec(case.schedule, case.microbatches, case.stages),
    )
    layout = strategy.layout
    assert layout.dp == len(case.shares)
    x, y = make_batch(case.global_batch, seed=7)
    # The loop's convention for every strategy: gradients are averaged over replicas.
    loss_scale = layout.dp / case.global_batch
    out = strategy.step(loop_share(x, y, layout.dp_rank, case.shares), loss_scale=loss_scale, lr=LR)
    return {
        "layout": layout,
        "loss_sum": out.loss_sum,
        "grads": {
            name: p.grad.clone()
            for name, p in strategy.model.named_parameters()
            if p.grad is not None
        },
    }


def _state_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{part}/{key}": (value.detach().clone() if isinstance(value, torch.Tensor) else value)
        for part in ("model", "optim")
        for key, value in state[part].items()
    }


def _pair_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """2 ranks: every case once, then 20 steps (loss curve), then a DCP save."""
    import torch.distributed.checkpoint as dcp

    results: dict[str, Any] = {
        "cases": {c.name: _run_case(rank, world_size, c, root) for c in PAIR_CASES}
    }
    strategy = PipelineStrategy()
    strategy.setup(make_workload(seed=0), _ctx(rank, world_size, root), make_spec("1f1b", 4))
    x, y = make_batch(16, seed=3)
    losses = []
    for _ in range(20):
        out = strategy.step(loop_share(x, y, 0, ((8, 8),)), loss_scale=1 / 16, lr=LR)
        losses.append(out.loss_sum / 16)
    results["losses"] = losses
    state = strategy.state_dict_for_checkpoint()
    dcp.save(state, checkpoint_id=str(Path(root) / "ckpt"))
    results["saved"] = _state_to_plain(state)
    results["bf16"] = _bf16_curve(rank, world_size, root, x, y)
    return results


def _bf16_curve(
    rank: int, world_size: int, root: str, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    """The same 20 steps with `mixed_precision: bf16` (CPU autocast: the spec refuses bf16
    without a GPU at submit, so it is set here past the check): the losses, the dtypes the
    stage's linears computed in, and the parameters'."""
    spec = make_spec("1f1b", 4)
    spec = spec.model_copy(
        update={
            "strategy": spec.strategy.model_copy(update={"mixed_precision": MixedPrecision.bf16})
        }
    )
    strategy = PipelineStrategy()
    strategy.setup(make_workload(seed=0), _ctx(rank, world_size, root), spec)
    computed: set[torch.dtype] = set()
    for module in strategy.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: computed.add(out.dtype))
    losses = []
    for _ in range(20):
        out = strategy.step(loop_share(x, y, 0, ((8, 8),)), loss_scale=1 / 16, lr=LR)
        losses.append(out.loss_sum / 16)
    params = {p.dtype for p in strategy.model.parameters()}
    return {"losses": losses, "computed": computed, "params": params}


def _quad_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """4 ranks: every case, then load the 2-rank checkpoint and take one step."""
    import torch.distributed.checkpoint as dcp

    results: dict[str, Any] = {
        "cases": {c.name: _run_case(rank, world_size, c, root) for c in QUAD_CASES}
    }
    strategy = PipelineStrategy()
    # A different seed, so a load that does nothing cannot pass.
    strategy.setup(make_workload(seed=1), _ctx(rank, world_size, root), make_spec("1f1b", 4))
    state = strategy.state_dict_for_checkpoint()
    dcp.load(state, checkpoint_id=str(Path(root) / "ckpt"))
    strategy.load_checkpoint_state(state)
    results["loaded"] = _state_to_plain(strategy.state_dict_for_checkpoint())
    # ... and into another split: 4 stages of 1 block each.
    four = PipelineStrategy()
    four.setup(make_workload(seed=1), _ctx(rank, world_size, root), make_spec("1f1b", 4, 4))
    state = four.state_dict_for_checkpoint()
    dcp.load(state, checkpoint_id=str(Path(root) / "ckpt"))
    four.load_checkpoint_state(state)
    results["loaded_4_stages"] = _state_to_plain(four.state_dict_for_checkpoint())
    x, y = make_batch(16, seed=3)
    share = loop_share(x, y, strategy.layout.dp_rank, ((4, 4), (4, 4)))
    strategy.step(share, loss_scale=2 / 16, lr=LR)
    results["after_step"] = {n: p.detach().clone() for n, p in strategy.model.named_parameters()}
    return results


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def pair(ckpt_root: str) -> list[dict[str, Any]]:
    return run_distributed(_pair_worker, 2, ckpt_root, timeout_s=120)


@pytest.fixture(scope="module")
def quad(pair: list[dict[str, Any]], ckpt_root: str) -> list[dict[str, Any]]:
    # Depends on `pair`: it loads the checkpoint the 2-rank run saved.
    return run_distributed(_quad_worker, 4, ckpt_root, timeout_s=120)


# ---------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------


def reference(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean loss and (clipped) gradients of the full model on the whole global batch."""
    model = make_model(seed=0)
    x, y = make_batch(case.global_batch, seed=7)
    loss = lm_loss(model(x), y)
    loss.backward()
    if case.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.grad_clip)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def check_against_reference(results: list[dict[str, Any]], case: Case) -> None:
    runs = [r["cases"][case.name] for r in results]
    ref_loss, ref_grads = reference(case)
    # Every rank agreed on the global batch's summed loss (only last stages hold a part).
    assert len({r["loss_sum"] for r in runs}) == 1
    loss = runs[0]["loss_sum"] / case.global_batch  # what the loop computes
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    seen: dict[str, torch.Tensor] = {}
    for run in runs:
        for name, grad in run["grads"].items():
            torch.testing.assert_close(
                grad,
                ref_grads[name],
                atol=GRAD_ATOL,
                rtol=GRAD_RTOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )
            if name in seen:  # replicas of one stage end bitwise equal (one all-reduce)
                assert torch.equal(grad, seen[name]), name
            seen[name] = grad
    assert set(seen) == set(ref_grads), "every parameter lives on exactly one stage"


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_layout_is_replica_major() -> None:
    layouts = [pipeline_layout(r, 6, 3) for r in range(6)]
    assert [(lay.dp_rank, lay.pp_rank) for lay in layouts] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
    ]  # fmt: skip
    assert all(lay.dp == 2 and lay.pp == 3 for lay in layouts)


@pytest.mark.parametrize(("world", "stages"), [(3, 2), (1, 2), (5, 4)])
def test_layout_rejects_partial_replicas(world: int, stages: int) -> None:
    with pytest.raises(ValueError, match=r"not a multiple of \d+ \(\d+ stages\)"):
        pipeline_layout(0, world, stages)


@pytest.mark.parametrize(
    ("samples", "max_chunks", "expected"), [(8, 4, 4), (6, 4, 3), (2, 4, 2), (7, 4, 1), (16, 4, 4)]
)
def test_pipeline_chunks(samples: int, max_chunks: int, expected: int) -> None:
    assert pipeline_chunks(samples, max_chunks) == expected


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.name)
def test_two_stages_match_reference(pair: list[dict[str, Any]], case: Case) -> None:
    assert [r["cases"][case.name]["layout"] for r in pair] == [
        Layout(dp=1, pp=2, dp_rank=0, pp_rank=0),
        Layout(dp=1, pp=2, dp_rank=0, pp_rank=1),
    ]
    check_against_reference(pair, case)


@pytest.mark.parametrize("case", QUAD_CASES, ids=lambda c: c.name)
def test_four_ranks_match_reference(quad: list[dict[str, Any]], case: Case) -> None:
    layouts = [r["cases"][case.name]["layout"] for r in quad]
    assert layouts == [pipeline_layout(r, 4, case.stages) for r in range(4)]
    check_against_reference(quad, case)


def test_loss_falls(pair: list[dict[str, Any]]) -> None:
    losses = pair[0]["losses"]
    assert pair[1]["losses"] == losses  # both stages agreed on the last stage's loss
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(b < a for a, b in itertools.pairwise(losses)) >= 15, losses


def _saved_union(pair: list[dict[str, Any]]) -> dict[str, Any]:
    union: dict[str, Any] = {}
    for r in pair:
        union.update(r["saved"])
    return union


def _assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in actual.items():
        assert key in expected, key
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, expected[key]), key
        else:
            assert value == expected[key], key


def test_stages_train_in_bf16_on_the_fp32_curve(pair: list[dict[str, Any]]) -> None:
    """bf16: each stage's linears compute in bf16, the parameters stay fp32, and the curve
    follows fp32's within bf16's precision."""
    fp32, bf16 = pair[1]["losses"], pair[1]["bf16"]
    assert pair[0]["bf16"]["losses"] == bf16["losses"]  # both stages hold the same loss
    assert all(torch.bfloat16 in r["bf16"]["computed"] for r in pair)
    assert all(r["bf16"]["params"] == {torch.float32} for r in pair)
    assert bf16["losses"][-1] < 0.5 * bf16["losses"][0]
    for a, b in zip(fp32, bf16["losses"], strict=True):
        assert b == pytest.approx(a, rel=0.05)


def test_checkpoint_reshards_to_two_replicas_and_four_stages(
    pair: list[dict[str, Any]], quad: list[dict[str, Any]]
) -> None:
    expected = _saved_union(pair)
    assert any(k.startswith("optim/state.") for k in expected)  # AdamW moments saved
    covered: set[str] = set()
    for r in quad:
        _assert_state_equal(r["loaded"], expected)
        covered |= set(r["loaded"])
    assert covered == set(expected)
    covered = set()
    for r in quad:
        _assert_state_equal(r["loaded_4_stages"], expected)
        covered |= set(r["loaded_4_stages"])
    assert covered == set(expected)
    # Replicas stay in lockstep after the load: same parameters after one more step.
    for a, b in ((quad[0], quad[2]), (quad[1], quad[3])):
        assert a["after_step"].keys() == b["after_step"].keys()
        for name in a["after_step"]:
            assert torch.equal(a["after_step"][name], b["after_step"][name]), name


def test_checkpoint_loads_into_unsplit_model(pair: list[dict[str, Any]], ckpt_root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make_model(seed=2)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, optim, options=CHECKPOINT_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(ckpt_root) / "ckpt"))  # no process group
    set_state_dict(
        model,
        optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=CHECKPOINT_OPTIONS,
    )
    model_sd, optim_sd = get_state_dict(model, optim, options=CHECKPOINT_OPTIONS)
    loaded = _state_to_plain({"model": model_sd, "optim": optim_sd})
    expected = _saved_union(pair)
    assert set(loaded) == set(expected)
    _assert_state_equal(loaded, expected)
    # The unsplit model computes what the pipeline trained: its loss is low.
    x, y = make_batch(16, seed=3)
    with torch.no_grad():
        assert lm_loss(model(x), y).item() == pytest.approx(pair[1]["losses"][-1], rel=0.5)


def test_spec_defaults_and_errors() -> None:
    from elastrain.workers.strategies.pipeline import PipelineOptions

    workload = {"name": "synthetic"}
    spec = JobSpec(name="p", workload=workload, strategy={"kind": "pipeline"})
    opts = PipelineOptions.from_spec(spec)
    assert (opts.stages, opts.microbatches, opts.schedule) == (2, 4, "1f1b")
    gpu = {
        "name": "p",
        "workload": workload,
        "strategy": {"kind": "pipeline", "mixed_precision": "bf16"},
        "scaling": {"use_gpu": True, "gpus_per_worker": 1},
    }
    assert PipelineOptions.from_spec(JobSpec.model_validate(gpu)).stages == 2  # bf16 trains
    fp16 = {**gpu, "strategy": {"kind": "pipeline", "mixed_precision": "fp16"}}
    with pytest.raises(
        ValueError, match=r"strategy\.mixed_precision: pipeline stages train in bf16"
    ):
        JobSpec.model_validate(fp16)  # refused at submit
    # One stored before that rule is a configuration error on the workers (not retried).
    with pytest.raises(WorkloadError, match="mixed_precision"):
        PipelineOptions.from_spec(JobSpec.from_stored(fp16))


def test_model_without_pipeline_stage_is_rejected() -> None:
    strategy = PipelineStrategy()
    workload = Workload(model=nn.Linear(2, 2), dataset=[], loss_fn=F.mse_loss)
    with pytest.raises(WorkloadError, match="pipeline_stage"):  # a configuration error
        strategy.setup(workload, _ctx(0, 2, "/tmp"), make_spec("gpipe", 2))
