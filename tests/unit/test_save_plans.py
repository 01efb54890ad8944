"""DCP's save plans are kept from save to save while the state's layout holds
(`elastrain.checkpoints.dcp.save_plans`), and a checkpoint so planned is the checkpoint
DCP's own planning writes: every save loads back to the state it saved, a layout that
changed (on any rank) is planned again, and the `.metadata` is DCP's.

Real gloo groups (FSDP2 on two ranks; plain tensors on two ranks, one of which changes
its layout alone), real files, loads through the checkpointer's verified load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.state_dict import set_state_dict

from elastrain.checkpoints.dcp import ShardedCheckpointer, writer
from elastrain.checkpoints.layout import step_dir
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoint_group_of_one import same_metadata_values
from tests.unit.test_checkpoints_dcp import (
    assert_same,
    build,
    ckpt_state,
    full_state,
    train,
)


def plans_made(ckpt: ShardedCheckpointer) -> tuple[int, int]:
    """(local plans, global plans) this checkpointer's planner has made so far."""
    return ckpt._planner.local_plans_made, ckpt._planner.global_plans_made


def loaded(root: Path, state: dict[str, Any], rank: int = 0, world_size: int = 1) -> None:
    """Load the newest checkpoint under `root` into `state`, in place."""
    reader = ShardedCheckpointer(root, rank=rank, world_size=world_size, async_save=False)
    assert reader.load_latest(state) is not None
    reader.close()


def counting_dcp_saves() -> list[int]:
    """Count, from now on in this process, the saves made by DCP's own `save` (the
    others exchanged no plans: `kept_save`)."""
    calls: list[int] = []
    original = state_dict_saver.save

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    state_dict_saver.save = counting  # the checkpointer looks it up at call time
    return calls


def _fsdp_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    dcp_saves = counting_dcp_saves()
    model, optim = build("fsdp")
    ckpt = ShardedCheckpointer(
        Path(root) / "kept", rank=rank, world_size=world_size, async_save=True
    )
    refs, loads = [], []
    for step in (1, 2, 3):
        train(model, optim, 1, seed=step)
        refs.append(full_state(model, optim))
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
        train(model, optim, 1, seed=10 + step)  # moves on while the save is written
        ckpt.finalize()
        fresh_model, fresh_optim = build("fsdp")
        state = ckpt_state(fresh_model, fresh_optim)
        loaded(Path(root) / "kept", state, rank, world_size)
        set_state_dict(
            fresh_model, fresh_optim, model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )  # fmt: skip
        loads.append(full_state(fresh_model, fresh_optim))
    made = plans_made(ckpt)
    ckpt.close()
    saves_by_dcp = len(dcp_saves)
    # The same last state planned from scratch, for its metadata.
    fresh = ShardedCheckpointer(
        Path(root) / "fresh", rank=rank, world_size=world_size, async_save=False,
        keep_plans=False,
    )  # fmt: skip
    fresh.save(step=3, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    fresh.close()
    return {"refs": refs, "loads": loads, "made": made, "saves_by_dcp": saves_by_dcp}


def test_fsdp_saves_plan_once_and_each_loads_its_own_step(tmp_path: Path) -> None:
    results = run_distributed(_fsdp_saves, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for step, (ref, got) in enumerate(zip(result["refs"], result["loads"], strict=True)):
            assert_same(ref, got, f"rank {rank}, save {step + 1}")
    # One local plan per rank, one global plan on the coordinator (rank 0), for 3 saves.
    assert [r["made"] for r in results] == [(1, 1), (1, 0)]
    # Only the first save went through DCP's exchanges; the next two wrote by the plans
    # every rank kept (`kept_save`), and loaded back all the same.
    assert [r["saves_by_dcp"] for r in results] == [1, 1]
    # The `.metadata` of the third save, planned from the first save's plans, is what
    # DCP's own planning of that state writes (trained one step further: same layout).
    kept = step_dir(tmp_path / "kept", 3, 0)
    assert same_metadata_values(kept, step_dir(tmp_path / "fresh", 3, 0))


def _one_rank_changes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    state: dict[str, Any] = {"shared": torch.ones(4), f"rank{rank}": torch.randn(3)}
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    made = []
    for step in (1, 2, 3):
        if step == 3 and rank == 1:
            state["rank1"] = torch.randn(7)  # rank 1's layout changes, rank 0's does not
        ckpt.save(step=step, attempt=0, state=dict(state), manifest_fields={})
        made.append(plans_made(ckpt))
    ckpt.close()
    back = {key: torch.zeros_like(value) for key, value in state.items()}
    loaded(Path(root), back, rank, world_size)
    dist.barrier()
    return {"made": made, "equal": all(torch.equal(back[k], state[k]) for k in state)}


def test_a_layout_changed_on_one_rank_is_planned_again_by_the_coordinator(
    tmp_path: Path,
) -> None:
    zero, one = run_distributed(_one_rank_changes, 2, str(tmp_path))
    assert zero["made"] == [(1, 1), (1, 1), (1, 2)]  # rank 1's new plan: a new global plan
    assert one["made"] == [(1, 0), (1, 0), (2, 0)]
    assert zero["equal"] and one["equal"]  # the third save's metadata has rank 1's 7 values


def _model_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = build("plain")
    train(model, optim, 1, seed=0)
    return model, optim, ckpt_state(model, optim)


def _values_only(model: Any, optim: Any, state: dict[str, Any]) -> None:
    train(model, optim, 1, seed=5)
    optim.param_groups[0]["lr"] = 0.5  # a value beside the tensors: written as it is now


def _tensor_resized(model: Any, optim: Any, state: dict[str, Any]) -> None:
    state["model"]["0.bias"] = torch.randn(32)


def _requires_grad_flipped(model: Any, optim: Any, state: dict[str, Any]) -> None:
    state["model"]["0.weight"].requires_grad_(True)  # the same storage: in the metadata only


def _key_added(model: Any, optim: Any, state: dict[str, Any]) -> None:
    state["extra"] = torch.arange(5.0)


@pytest.mark.parametrize(
    ("change", "planned_again"),
    [
        (_values_only, False),
        (_tensor_resized, True),
        (_requires_grad_flipped, True),
        (_key_added, True),
    ],
)
def test_what_plans_a_save_again(change: Any, planned_again: bool, tmp_path: Path) -> None:
    model, optim, state = _model_state()
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    ckpt.save(step=1, attempt=0, state=state, manifest_fields={})
    change(model, optim, state)
    if change is _values_only:
        state = ckpt_state(model, optim)
    ckpt.save(step=2, attempt=0, state=state, manifest_fields={})
    ckpt.close()
    assert plans_made(ckpt) == ((2, 2) if planned_again else (1, 1))
    back: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {
            "state": {
                k: {n: torch.zeros_like(t) for n, t in s.items()}
                for k, s in state["optim"]["state"].items()
            },
            "param_groups": [dict(g, lr=0.0) for g in state["optim"]["param_groups"]],
        },
        **({"extra": torch.zeros(5)} if "extra" in state else {}),
    }
    loaded(tmp_path, back)
    assert_same(state, back)


def test_a_failed_save_plans_the_next_one_from_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = _model_state()
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    ckpt.save(step=1, attempt=0, state=state, manifest_fields={})
    write_data = writer.DigestingWriter.write_data

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk gone")

    monkeypatch.setattr(writer.DigestingWriter, "write_data", failing)
    with pytest.raises(BaseException, match="disk gone"):
        ckpt.save(step=2, attempt=0, state=state, manifest_fields={})
    monkeypatch.setattr(writer.DigestingWriter, "write_data", write_data)
    ckpt.save(step=3, attempt=0, state=state, manifest_fields={})
    ckpt.close()
    assert plans_made(ckpt) == (2, 2)  # the first save's, then the third's


def test_a_ddp_ranks_staging_finds_its_items_once_per_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastrain.checkpoints.dcp import own_items as module

    found: list[int] = []
    own_items = module.own_items

    def counting(planner: Any, rank: int, world_size: int) -> Any:
        found.append(rank)
        return own_items(planner, rank, world_size)

    monkeypatch.setattr(module, "own_items", counting)
    live: dict[str, Any] = {f"layer{i}": torch.randn(1000 * (i + 1)) for i in range(4)}
    stager = module.OwnItemsStager(1, 2, pin=False)
    for step in (1, 2, 3):
        if step == 3:
            live["layer0"] = torch.randn(7)  # another layout: its items found again
        for tensor in live.values():
            tensor.add_(1.0)
        copy = stager.stage(live, step=step).result()
        assert copy.items and all(torch.equal(data, live[i.fqn]) for i, data in copy.items.items())
    stager.close()
    assert found == [1, 1]  # the first save's layout, then the third's


def _write_fails_on_rank_1(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from elastrain.checkpoints.layout import MANIFEST_NAME

    dcp_saves = counting_dcp_saves()
    state: dict[str, Any] = {f"rank{rank}": torch.full((64,), float(rank)), "note": "short"}
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    ckpt.save(step=1, attempt=0, state=dict(state), manifest_fields={})
    write_data = writer.DigestingWriter.write_data
    if rank == 1:

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise OSError("disk gone")

        writer.DigestingWriter.write_data = failing  # type: ignore[method-assign]
    errors = []
    try:
        ckpt.save(step=2, attempt=0, state=dict(state), manifest_fields={})
    except Exception as e:  # a sync save raises what failed, as it is
        errors.append(repr(e))
    writer.DigestingWriter.write_data = write_data  # type: ignore[method-assign]
    ckpt.save(step=3, attempt=0, state=dict(state), manifest_fields={})
    # A value beside the tensors grows: where this rank's items go changes, its plan not.
    state["note"] = "a longer note " * 100
    ckpt.save(step=4, attempt=0, state=dict(state), manifest_fields={})
    ckpt.close()
    back = {f"rank{rank}": torch.zeros(64), "note": ""}
    loaded(Path(root), back, rank, world_size)
    dist.barrier()
    return {
        "errors": errors,
        "dcp_saves": len(dcp_saves),
        "back": back,
        "committed": [
            s for s in (1, 2, 3, 4) if (step_dir(Path(root), s, 0) / MANIFEST_NAME).exists()
        ],
    }


def test_a_write_failed_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    zero, one = run_distributed(_write_fails_on_rank_1, 2, str(tmp_path))
    assert "disk gone" in one["errors"][0]  # its own error
    assert "rank 1" in zero["errors"][0] and "disk gone" in zero["errors"][0]
    assert zero["committed"] == [1, 3, 4]  # nothing for the failed save
    # The save after a failure is planned (through DCP) afresh; the one after it not.
    assert zero["dcp_saves"] == one["dcp_saves"] == 2
    assert zero["back"]["note"] == one["back"]["note"] == "a longer note " * 100
    assert torch.equal(one["back"]["rank1"], torch.full((64,), 1.0))
