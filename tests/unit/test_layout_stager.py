"""The async save's staging copy (`LayoutStager`): DCP's stager makes the first copy of a
state's layout; later saves of that layout copy bytes into the same buffers. Every copy
must hold the state as it was when staged, whatever changes after."""

from __future__ import annotations

import shutil
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.shard_file import is_aligned
from elastrain.checkpoints.dcp.staging import AlignedStateDictStager, LayoutStager, layout_of
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import (
    assert_same,
    build,
    ckpt_state,
    full_state,
    load_into_fresh,
    train,
)

BIG = 1 << 20  # elements: a 4 MB storage, staged page-aligned


def counting_dcp_stages(calls: list[int]) -> Any:
    """DCP's stager's `stage`, noting in `calls` each whole state it copies."""
    original = AlignedStateDictStager.stage

    def counted(self: AlignedStateDictStager, state: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, state, **kwargs)

    return counted


@pytest.fixture
def dcp_stages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times DCP's own stager copied a whole state."""
    calls: list[int] = []
    monkeypatch.setattr(AlignedStateDictStager, "stage", counting_dcp_stages(calls))
    return calls


@pytest.fixture
def stager() -> Any:
    s = LayoutStager(device_copies=False)
    yield s
    s.close()


def optimizer_like_state() -> dict[str, Any]:
    big, small = torch.randn(BIG), torch.randn(10)
    return {
        "model": OrderedDict(w=big, b=small, view=big[4:].view(-1, 4), tied=big),
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(BIG)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"], "fused": None}],
        },
        "step": 3,
    }


def stage(stager: LayoutStager, state: dict[str, Any]) -> dict[str, Any]:
    return stager.stage(state).result(timeout=60)


def test_later_saves_of_a_layout_copy_bytes_into_the_first_saves_buffers(
    stager: LayoutStager, dcp_stages: list[int]
) -> None:
    state = optimizer_like_state()
    first = stage(stager, state)
    first_ptr = first["model"]["w"].untyped_storage().data_ptr()
    for k in range(3):
        state["model"]["w"].add_(1.0)
        state["optim"]["state"]["w"]["exp_avg"].sub_(2.0)
        state["optim"]["state"]["w"]["step"].add_(1)
        staged = stage(stager, state)
        assert_same(staged, state)
        assert staged["optim"]["state"]["w"]["step"].item() == 4 + k
        assert staged["model"]["w"].untyped_storage().data_ptr() == first_ptr
    assert dcp_stages == [1]  # the first save only
    assert is_aligned(memoryview(staged["model"]["w"].numpy()).cast("B"))
    # Views and tied weights share one staged storage, as they share the live one.
    for name in ("view", "tied"):
        assert staged["model"][name].untyped_storage().data_ptr() == first_ptr
    assert type(staged["model"]) is OrderedDict and staged["step"] == 3


def test_the_copy_holds_the_state_as_it_was_when_staged(stager: LayoutStager) -> None:
    state = optimizer_like_state()
    stage(stager, state)
    expected = {"w": state["model"]["w"].clone(), "exp_avg": torch.full((BIG,), 7.0)}
    state["optim"]["state"]["w"]["exp_avg"].fill_(7.0)
    staged = stage(stager, state)  # the fast path
    state["model"]["w"].mul_(-1.0)
    state["optim"]["state"]["w"]["exp_avg"].zero_()
    group = state["optim"]["param_groups"][0]
    group["lr"] = 0.5  # a scheduler's update of a param group
    group["params"].append("b")
    assert torch.equal(staged["model"]["w"], expected["w"])
    assert torch.equal(staged["optim"]["state"]["w"]["exp_avg"], expected["exp_avg"])
    staged_group = staged["optim"]["param_groups"][0]
    assert staged_group["lr"] == 0.1 and staged_group["params"] == ["w"]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s["model"].update(w=torch.randn(BIG + 8)), id="a tensor's size"),
        pytest.param(lambda s: s["model"].update(b=s["model"]["b"].double()), id="a dtype"),
        pytest.param(lambda s: s["model"].update(w=s["model"]["w"].clone()), id="a new tensor"),
        pytest.param(lambda s: s["model"].update(extra=torch.ones(3)), id="a key added"),
        pytest.param(lambda s: s["optim"]["param_groups"].append({}), id="a container"),
        pytest.param(lambda s: s.update(step=3.5), id="a value's type"),
    ],
)
def test_a_changed_layout_is_staged_afresh(
    stager: LayoutStager, dcp_stages: list[int], change: Any
) -> None:
    state = optimizer_like_state()
    stage(stager, state)
    change(state)
    staged = stage(stager, state)
    assert dcp_stages == [1, 1]
    assert_same(staged, state)
    state["model"]["w"].add_(1.0)  # the new layout's buffers are kept: bytes only now
    assert_same(stage(stager, state), state)
    assert dcp_stages == [1, 1]


Pair = namedtuple("Pair", "first second")


class Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda t: Pair(t, 1), id="a namedtuple"),
        pytest.param(Holder, id="an object holding a tensor"),
    ],
)
def test_a_state_holding_other_objects_is_staged_by_dcp_every_time(
    stager: LayoutStager, dcp_stages: list[int], odd: Any
) -> None:
    live = torch.randn(100)
    state = {"w": torch.randn(BIG), "odd": odd(live)}
    assert layout_of(state, []) is None
    for _ in range(2):
        expected = live.clone()
        staged = stage(stager, state)
        live.add_(1.0)
        inner = staged["odd"][0] if isinstance(staged["odd"], tuple) else staged["odd"].tensor
        assert torch.equal(inner, expected)
    assert dcp_stages == [1, 1]


# -- end to end: async saves of an FSDP state, one after another -------------------------


def _fsdp_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    calls: list[int] = []
    AlignedStateDictStager.stage = counting_dcp_stages(calls)  # type: ignore[method-assign]
    model, optim = build("fsdp")
    ckpt = ShardedCheckpointer(
        Path(root), rank=rank, world_size=world_size, async_save=True, async_staging=True
    )
    refs = {}
    for step in (1, 2, 3):
        train(model, optim, 1, seed=step)
        refs[step] = full_state(model, optim)
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
        ckpt.wait_staged()
        train(model, optim, 1, seed=10 + step)  # in place, while the write may still run
    ckpt.close()
    loaded = {}
    for step in (3, 2, 1):
        loaded[step] = load_into_fresh("fsdp", root, world_size)
        if rank == 0:
            shutil.rmtree(Path(root) / f"step_{step:09d}-a0")
        torch.distributed.barrier()
    return {"refs": refs, "loaded": loaded, "dcp_stages": len(calls)}


def test_fsdp_async_saves_in_a_row_each_hold_their_step(tmp_path: Path) -> None:
    for got in run_distributed(_fsdp_saves, 2, str(tmp_path), timeout_s=240):
        assert got["dcp_stages"] == 1  # later saves copied bytes into the first's buffers
        for step, loaded in got["loaded"].items():
            assert loaded["step"] == step
            assert_same(loaded["full"], got["refs"][step], f"step {step}")
