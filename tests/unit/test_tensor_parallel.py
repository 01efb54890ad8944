"""Tensor parallelism on gloo/CPU: `tp`, `fsdp` x tp (2-D) and pipeline x tp x dp (3-D).

The gpt trained by the real loop under each layout gives the single-process reference's
losses (float tolerance) on the same batches; a job stopped at one data-parallel size
resumes at another on the same curve; and a sharded checkpoint saved under one layout
loads bit for bit under another dp size (and into a model without tensor parallelism).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from elastrain.contracts.spec import JobSpec
from elastrain.workers.strategies.mesh import grid_layout
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import assert_same
from tests.unit.test_workers_train import crcs, losses, run_jobs

STEPS = 6
RTOL = 2e-5
GPT = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 16}


def gpt_spec(strategy: dict[str, Any], *, every: int = 100) -> JobSpec:
    return JobSpec(
        name="t",
        workload={"name": "gpt", "params": GPT},
        strategy=strategy,
        scaling={"min_workers": 1, "max_workers": 8},
        training={
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": STEPS,
            "learning_rate": 1e-2, "lr_schedule": "cosine", "warmup_steps": 2, "seed": 3,
            # Clipping bites on these steps: the norm spans every rank's shard.
            "grad_clip": 0.5,
        },
        checkpoint={"every_steps": every, "async_save": True},
    )  # fmt: skip


TP = {"kind": "tp", "tensor_parallel": 2}
FSDP_TP = {"kind": "fsdp", "tensor_parallel": 2}
PP_TP = {"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 2, "microbatches": 2}


# -- checkpoints at the strategy level (module level: spawned processes import them) ----


def _strategy(strategy: dict[str, Any], rank: int, world_size: int, root: str) -> Any:
    from elastrain.workers.api import TrainContext
    from elastrain.workers.rng import seed_everything
    from elastrain.workers.strategies import make_strategy
    from elastrain.workers.workloads import load_workload

    spec = gpt_spec(strategy)
    seed_everything(3)
    workload = load_workload(spec.workload)
    st = make_strategy(spec.strategy.kind)
    ctx = TrainContext(
        rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
        job_id=1, attempt=world_size, checkpoint_root=Path(root), log_path=Path(root) / "log",
    )  # fmt: skip
    st.setup(workload, ctx, spec)
    return st, workload


def full_state(st: Any) -> dict[str, torch.Tensor]:
    """This rank's model + optimizer state, unsharded, by flat key (a pipeline stage holds
    only its own keys; the caller merges the ranks')."""
    opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(st.model, st.optimizer, options=opts)
    out: dict[str, Any] = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        for key, value in sd.items():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"{prefix}.{key}"] = full.detach().clone()
            else:
                out[f"{prefix}.{key}"] = value
    return out


def save_after_steps(rank: int, world_size: int, strategy: dict[str, Any], root: str) -> Any:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

    st, workload = _strategy(strategy, rank, world_size, root)
    samples = [workload.dataset[i] for i in range(4)]
    batch = (torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples]))
    lr = gpt_spec(strategy).training.learning_rate  # what setup gave the optimizer
    for _ in range(3):
        st.step([batch], loss_scale=1.0 / 4, lr=lr)
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    ckpt.save(step=3, attempt=0, state=st.state_dict_for_checkpoint(),
              manifest_fields={"strategy": strategy["kind"]})  # fmt: skip
    ckpt.close()
    return full_state(st)


def load_latest(rank: int, world_size: int, strategy: dict[str, Any], root: str) -> Any:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

    st, _ = _strategy(strategy, rank, world_size, root + "-load")
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    state = st.state_dict_for_checkpoint()
    outcome = ckpt.load_latest(state)
    assert outcome is not None and outcome.info.step == 3
    st.load_checkpoint_state(state)
    ckpt.close()
    return full_state(st)


def run_all(
    rank: int,
    world_size: int,
    jobs: list[tuple[str, str, JobSpec, list[str]]],
    saves: list[tuple[str, dict[str, Any], str]],
    loads: list[tuple[str, dict[str, Any], str]],
) -> dict[str, Any]:
    """Loop runs, then checkpoint saves and loads, in one spawn of this world size."""
    out: dict[str, Any] = dict(run_jobs(rank, world_size, jobs) or {}) if jobs else {}
    for label, strategy, root in saves:
        out[label] = save_after_steps(rank, world_size, strategy, root)
    for label, strategy, root in loads:
        out[label] = load_latest(rank, world_size, strategy, root)
    dist.barrier()
    return out


def merged(results: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """Every rank's keys (pipeline stages hold different ones); ranks holding the same key
    must agree exactly."""
    out: dict[str, Any] = {}
    for got in results:
        for key, value in got[label].items():
            if key in out:
                assert_same(out[key], value, f"{label}:{key}")
            out[key] = value
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")

    def d(name: str) -> str:
        return str(root / name)

    stop_after_3 = ["none", "none", "stop"]
    spawned: dict[str, list[dict[str, Any]]] = {}
    # dp = 2 (fsdp x tp, tp) ...
    spawned["ws4"] = run_distributed(run_all, 4, [
        ("tp_dp2", d("tp_dp2"), gpt_spec(TP), []),
        ("fsdp_tp_stop", d("fsdp_tp"), gpt_spec(FSDP_TP), stop_after_3),
    ], [("save_fsdp_tp", FSDP_TP, d("ck_fsdp_tp")), ("save_tp", TP, d("ck_tp"))], [],
        timeout_s=600)  # fmt: skip
    # ... 3-D: dp 2 x pp 2 x tp 2 ...
    spawned["ws8"] = run_distributed(run_all, 8, [
        ("pp_tp_stop", d("pp_tp"), gpt_spec(PP_TP), stop_after_3),
    ], [("save_pp_tp", PP_TP, d("ck_pp_tp"))], [], timeout_s=600)  # fmt: skip
    # ... resumed and loaded at dp = 1.
    spawned["ws2"] = run_distributed(run_all, 2, [
        ("tp_dp1", d("tp_dp1"), gpt_spec(TP), []),
        ("fsdp_tp_resume", d("fsdp_tp"), gpt_spec(FSDP_TP), []),
    ], [], [
        ("load_fsdp_tp", FSDP_TP, d("ck_fsdp_tp")),
        ("load_tp", TP, d("ck_tp")),
        # Tensor-parallel checkpoints into models without tensor parallelism.
        ("load_fsdp_from_tp", {"kind": "fsdp"}, d("ck_fsdp_tp")),
        ("load_pp_from_pp_tp", {"kind": "pipeline", "microbatches": 2}, d("ck_pp_tp")),
    ], timeout_s=600)  # fmt: skip
    spawned["ws4b"] = run_distributed(run_all, 4, [
        ("pp_tp_resume", d("pp_tp"), gpt_spec(PP_TP), []),
    ], [], [("load_pp_tp", PP_TP, d("ck_pp_tp"))], timeout_s=600)  # fmt: skip
    spawned["ws1"] = run_distributed(run_all, 1, [
        ("reference", d("reference"), gpt_spec({"kind": "ddp"}), []),
    ], [], [("load_ddp_from_tp", {"kind": "ddp"}, d("ck_tp"))], timeout_s=600)  # fmt: skip
    return spawned


def test_grid_layout_puts_tensor_parallel_ranks_innermost() -> None:
    got = [grid_layout(r, 8, pp=2, tp=2) for r in range(8)]
    assert [(g.dp_rank, g.pp_rank, g.tp_rank) for g in got] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip
    assert {(g.dp, g.pp, g.tp) for g in got} == {(2, 2, 2)}
    assert grid_layout(3, 4, tp=2) == grid_layout(3, 4, pp=1, tp=2)
    assert (grid_layout(3, 4, tp=2).dp_rank, grid_layout(3, 4, tp=2).tp_rank) == (1, 1)


@pytest.mark.parametrize(("world", "pp", "tp"), [(3, 1, 2), (2, 2, 2), (6, 2, 2), (1, 1, 2)])
def test_grid_layout_rejects_partial_replicas(world: int, pp: int, tp: int) -> None:
    with pytest.raises(ValueError, match="whole model replicas"):
        grid_layout(0, world, pp=pp, tp=tp)


@pytest.mark.parametrize("label", ["tp_dp1", "tp_dp2", "fsdp_tp_stop", "pp_tp_stop"])
def test_losses_equal_the_single_process_reference(runs: dict[str, Any], label: str) -> None:
    ref = runs["ws1"][0]["reference"]
    ws = {"tp_dp1": "ws2", "tp_dp2": "ws4", "fsdp_tp_stop": "ws4", "pp_tp_stop": "ws8"}[label]
    got = runs[ws][0][label]
    n = len(got["metrics"])
    assert n == (STEPS if "stop" not in label else 3)
    assert crcs(got) == crcs(ref)[:n], "the same batches"
    assert losses(got) == pytest.approx(losses(ref)[:n], rel=RTOL)
    assert losses(ref)[-1] < losses(ref)[0]


@pytest.mark.parametrize(
    ("stopped", "resumed"), [("fsdp_tp_stop", "fsdp_tp_resume"), ("pp_tp_stop", "pp_tp_resume")]
)
def test_resume_at_another_data_parallel_size(
    runs: dict[str, Any], stopped: str, resumed: str
) -> None:
    first = runs["ws4" if stopped.startswith("fsdp") else "ws8"][0][stopped]
    second = runs["ws2" if resumed.startswith("fsdp") else "ws4b"][0][resumed]
    ref = runs["ws1"][0]["reference"]
    assert second["result"].resumed_from_step == 3
    assert crcs(first) + crcs(second) == crcs(ref)
    assert losses(first) + losses(second) == pytest.approx(losses(ref), rel=RTOL)


def test_tensor_parallel_shards_the_blocks(runs: dict[str, Any]) -> None:
    """Per-rank parameter bytes: tp 2 holds about half of what one replica of ddp does."""
    ref = runs["ws1"][0]["reference"]["metrics"][-1].memory["param_bytes"]
    tp = runs["ws2"][0]["tp_dp1"]["metrics"][-1].memory["param_bytes"]
    fsdp_tp = runs["ws4"][0]["fsdp_tp_stop"]["metrics"][-1].memory["param_bytes"]
    # Only the layer norms are whole on every tp rank.
    assert 0.5 * ref < tp < 0.56 * ref
    assert 0.25 * ref < fsdp_tp < 0.3 * ref


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        (("ws4", "save_fsdp_tp"), ("ws2", "load_fsdp_tp")),
        (("ws4", "save_tp"), ("ws2", "load_tp")),
        (("ws4", "save_fsdp_tp"), ("ws2", "load_fsdp_from_tp")),
        (("ws8", "save_pp_tp"), ("ws4b", "load_pp_tp")),
        (("ws8", "save_pp_tp"), ("ws2", "load_pp_from_pp_tp")),
        (("ws4", "save_tp"), ("ws1", "load_ddp_from_tp")),
    ],
)
def test_checkpoint_loads_exactly_at_another_size(
    runs: dict[str, Any], saved: tuple[str, str], loaded: tuple[str, str]
) -> None:
    want = merged(runs[saved[0]], saved[1])
    got = merged(runs[loaded[0]], loaded[1])
    assert set(got) == set(want)
    assert_same(got, want)
