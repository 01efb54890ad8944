"""The training loop end to end on gloo (CPU): ddp and fsdp, world sizes 1 and 2, control,
checkpoint and resume. Three spawns of the loop are shared by every test of this module,
because starting torch processes dominates the runtime on a 2-core machine."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain.contracts.messages import EventKind
from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import Control, TrainContext
from elastrain.workers.lr_schedule import lr_at
from tests.unit.dist_utils import run_distributed
from tests.unit.hooks import RecordingHooks

STEPS = 8


def make_spec(kind: str, *, global_batch: int = 32, micro: int = 8, every: int = 4) -> JobSpec:
    return JobSpec(
        name="t",
        workload={"name": "synthetic", "params": {"num_samples": 512}},
        strategy={"kind": kind},
        training={
            "global_batch_size": global_batch,
            "micro_batch_size": micro,
            "max_steps": STEPS,
            "learning_rate": 1e-2,
            # Warm-up then cosine: every equality below (world sizes, resume at another
            # size) also holds the schedule to being a function of the step alone.
            "lr_schedule": "cosine",
            "warmup_steps": 2,
            "min_lr": 1e-3,
            "seed": 5,
        },
        checkpoint={"every_steps": every, "async_save": True},
    )


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str, JobSpec, list[str]]]) -> Any:
    """Run `train()` once per job, one after the other, in this rank's process."""
    from elastrain.workers.loop import train

    out = {}
    for label, root, spec, controls in jobs:
        hooks = RecordingHooks(controls=[Control(c) for c in controls])
        ctx = TrainContext(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            device=torch.device("cpu"),
            job_id=1,
            attempt=world_size,  # a new attempt per world size, as after a resize
            checkpoint_root=Path(root),
            log_path=Path(root) / f"rank{rank}.log",
        )
        t0 = time.perf_counter()
        result = train(ctx, spec, hooks)
        out[label] = {
            "result": result,
            "metrics": hooks.metrics,
            "commits": hooks.commits,
            "events": hooks.events,
            "resumed": hooks.resumed,
            "ctx_step": ctx.step,
            "seconds": time.perf_counter() - t0,
        }
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("train")
    uneven = {"global_batch": 3, "micro": 1}  # ws=2: shares 2 and 1 -> an empty micro-batch
    ws2 = [
        ("ddp2", str(root / "ddp2"), make_spec("ddp"), []),
        ("fsdp2", str(root / "fsdp2"), make_spec("fsdp"), []),
        ("uneven_ddp2", str(root / "uneven_ddp2"), make_spec("ddp", **uneven), []),
        ("uneven_fsdp2", str(root / "uneven_fsdp2"), make_spec("fsdp", **uneven), []),
        # STOP arrives with the third poll: save after step 3 and return.
        ("stop2", str(root / "stop"), make_spec("fsdp", every=100), ["none", "none", "stop"]),
    ]
    ws1 = [
        ("ddp1", str(root / "ddp1"), make_spec("ddp"), []),
        ("uneven_ddp1", str(root / "uneven_ddp1"), make_spec("ddp", **uneven), []),
        # Resume the stopped fsdp job at world size 1 (DCP reshards 2 -> 1).
        ("resume1", str(root / "stop"), make_spec("fsdp", every=100), []),
    ]
    out = run_distributed(run_jobs, 2, ws2, timeout_s=600)[0]
    corrupt_a_newer_copy(root / "stop", "step_000000003-a2", "step_000000005-a2")
    out.update(run_distributed(run_jobs, 1, ws1, timeout_s=600)[0])
    return out


def corrupt_a_newer_copy(root: Path, good: str, bad: str) -> None:
    """A newer checkpoint whose shard is damaged: resume must skip it, say so, and load
    the older good one."""
    shutil.copytree(root / good, root / bad)
    manifest = json.loads((root / bad / "manifest.json").read_text())
    manifest["step"] = 5
    (root / bad / "manifest.json").write_text(json.dumps(manifest))
    shard = next((root / bad).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])


def losses(run: dict[str, Any]) -> list[float]:
    return [m.loss for m in run["metrics"]]


def crcs(run: dict[str, Any]) -> list[int]:
    return [m.batch_crc for m in run["metrics"]]


@pytest.mark.parametrize("label", ["ddp1", "ddp2", "fsdp2"])
def test_loss_falls_and_metrics_every_step(runs: dict, label: str) -> None:
    run = runs[label]
    assert [m.step for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert losses(run)[-1] < 0.5 * losses(run)[0]
    point = run["metrics"][-1]
    assert point.world_size == point.dp == int(label[-1]) and point.pp == 1
    assert point.samples_per_s and point.samples_per_s > 0 and point.tokens_per_s is None
    # Model FLOPs are known (6 per parameter per sample); a CPU has no known peak.
    assert point.model_flops_per_s and point.model_flops_per_s > 0 and point.mfu is None
    first = run["metrics"][0]
    assert "ELASTRAIN_PEAK_FLOPS" in (first.mfu_basis or "") and point.mfu_basis is None
    schedule = make_spec("ddp").training
    assert [m.lr for m in run["metrics"]] == [lr_at(s, schedule) for s in range(STEPS)]
    assert run["result"].final_step == STEPS and not run["result"].stopped_early
    assert run["ctx_step"] == STEPS  # the loop keeps TrainContext.step current
    # every_steps=4 and the final step: committed at 4 and 8.
    assert [c.step for c in run["commits"]] == [4, 8]


# Same global batch, same ids, same initial weights: the runs differ only in how float
# sums are grouped (per-rank partial sums, the all-reduce, FSDP's reduce-scatter), about
# 1e-7 relative per step in float32 (we measured at most 2e-7 over these 8 steps). AdamW
# normalises updates by sqrt(v), which keeps that from growing much over a few steps; 1e-5
# leaves a wide margin yet catches any real mistake (a wrong loss scale, a sample seen twice
# or missed), which shifts the loss by far more than 1e-3.
RTOL = 1e-5


@pytest.mark.parametrize("label", ["ddp2", "fsdp2"])
def test_world_size_does_not_change_the_curve(runs: dict, label: str) -> None:
    assert crcs(runs[label]) == crcs(runs["ddp1"])
    assert losses(runs[label]) == pytest.approx(losses(runs["ddp1"]), rel=RTOL)


@pytest.mark.parametrize("label", ["uneven_ddp2", "uneven_fsdp2"])
def test_uneven_shares_and_empty_microbatches(runs: dict, label: str) -> None:
    assert crcs(runs[label]) == crcs(runs["uneven_ddp1"])
    assert losses(runs[label]) == pytest.approx(losses(runs["uneven_ddp1"]), rel=RTOL)


def test_fsdp_shards_params_and_optimizer_state(runs: dict) -> None:
    ddp = runs["ddp2"]["metrics"][-1].memory
    fsdp = runs["fsdp2"]["metrics"][-1].memory
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        # Dim-0 shards over 2 ranks: half, up to the padding of odd-sized dims.
        assert fsdp[key] <= 0.55 * ddp[key], key
    assert ddp["rss_bytes"] > 0


def test_stop_saves_and_returns(runs: dict) -> None:
    run = runs["stop2"]
    assert run["result"].stopped_early and run["result"].final_step == 3
    assert run["ctx_step"] == 3
    assert [m.step for m in run["metrics"]] == [1, 2, 3]
    commit = run["commits"][-1]
    assert commit.step == 3 and commit.attempt == 2 and commit.world_size == 2
    manifest = commit.manifest
    assert manifest is not None
    assert manifest["data_position"] == {"step": 3, "samples_consumed": 96}
    assert manifest["layout"] == {"dp": 2, "pp": 1, "tp": 1} and manifest["strategy"] == "fsdp"
    extra = dict(manifest["extra"])
    saved = extra.pop("metrics")
    assert extra.pop("save_started_at") <= manifest["created_at"]
    assert extra == {"seed": 5, "global_batch_size": 32, "micro_batch_size": 8}
    # The steps since the previous checkpoint travel with it (see the resume test).
    assert saved == [m.to_point() for m in run["metrics"]]


def test_resume_continues_the_same_sample_stream(runs: dict) -> None:
    resumed, stopped = runs["resume1"], runs["stop2"]
    assert resumed["result"].resumed_from_step == 3
    assert [m.step for m in resumed["metrics"]] == list(range(4, STEPS + 1))
    # The interrupted-then-resized run sees exactly the batches of the uninterrupted one...
    assert crcs(stopped) + crcs(resumed) == crcs(runs["fsdp2"])
    # ...and follows its loss curve (model and AdamW state restored, resharded 2 -> 1).
    assert losses(stopped) + losses(resumed) == pytest.approx(losses(runs["fsdp2"]), rel=RTOL)
    # The damaged newer copy was reported and passed over.
    [fallback] = resumed["events"]
    assert fallback.event is EventKind.CHECKPOINT_FALLBACK and fallback.reason
    assert fallback.details is not None
    assert fallback.details["path"].endswith("step_000000005-a2")
    resume = resumed["resumed"]
    assert resume is not None and resume.step == 3
    assert (resume.saved_world_size, resume.world_size) == (2, 1)
    assert resume.path.endswith("step_000000003-a2")
    # It hands back the steps saved with the checkpoint, for reports that never arrived.
    assert resume.saved_attempt == 2
    assert resume.metrics == tuple(stopped["metrics"])
    # ...and goes on keeping them: its own checkpoint carries the steps of both attempts.
    final = resumed["commits"][-1].manifest
    assert final is not None
    assert [p["step"] for p in final["extra"]["metrics"]] == list(range(1, STEPS + 1))
    log = (Path(resumed["commits"][-1].path).parent / "rank0.log").read_text()
    assert "resumed from" in log


def test_train_needs_a_process_group(tmp_path: Path) -> None:
    from elastrain.workers.loop import train

    ctx = TrainContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), job_id=1, attempt=1,
        checkpoint_root=tmp_path,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="process group"):
        train(ctx, make_spec("ddp"), RecordingHooks())
