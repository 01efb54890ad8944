"""An async save of a state in host memory written from the live tensors, with no staging
copy (`ShardedCheckpointer.save(in_place=True)`), the next update waiting for the write:

- `wait_staged()` returns only once the save's data is written, so the tensors the
  update then changes are saved as they were at the save; the non-tensor values (a param
  group's learning rate) are copied at save();
- a failed write raises at `wait_staged()` in the caller, as a failed staging copy does;
- the strategy's state for such a save holds copies of the module buffers (a forward may
  change them in place: batch norm, DDP's broadcast) and the live weights;
- `writes_in_place` decides it: host memory, async, a timed write within half a step.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_saver

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError
from elastrain.workers.checkpointing import writes_in_place
from elastrain.workers.strategies.base import Strategy


def live_state() -> dict[str, Any]:
    return {
        "w": torch.full((300_000,), 1.0),
        "optim": {"param_groups": [{"lr": 0.5, "params": ["w"]}]},
    }


def load(root: Path) -> dict[str, Any]:
    target = live_state()
    target["w"].zero_()
    target["optim"]["param_groups"][0]["lr"] = 0.0
    reader = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False)
    assert reader.load_latest(target) is not None
    return target


def test_the_update_waits_for_the_write_of_the_live_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold, writing = threading.Event(), threading.Event()
    original = state_dict_saver.save

    def held_save(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert hold.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save", held_save)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True,
                               async_staging=True)  # fmt: skip
    live = live_state()
    assert ckpt.last_write_s is None
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)
    assert ckpt._stager is None and ckpt._own_stager is None  # no staging copy
    live["optim"]["param_groups"][0]["lr"] = 9.0  # the next step's schedule: not saved

    waited: list[float] = []
    update = threading.Thread(target=lambda: waited.append(ckpt.wait_staged()))
    update.start()
    assert writing.wait(30)
    update.join(0.3)
    assert update.is_alive()  # the update waits for the write, not for a copy
    hold.set()
    update.join(30)
    assert waited and waited[0] >= 0.3
    live["w"].add_(1.0)  # the update, once allowed

    assert [c.step for c in ckpt.close()] == [1]
    assert ckpt.last_write_s is not None and ckpt.last_write_s >= 0.3
    saved = load(tmp_path)
    assert torch.equal(saved["w"], torch.full((300_000,), 1.0))
    assert saved["optim"]["param_groups"][0]["lr"] == 0.5


def test_a_failed_in_place_write_raises_before_the_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_save(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(state_dict_saver, "save", failing_save)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True,
                               async_staging=True)  # fmt: skip
    ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={}, in_place=True)
    with pytest.raises(CheckpointSaveError, match="disk full"):
        ckpt.wait_staged()
    with pytest.raises(CheckpointSaveError):
        ckpt.close()
    assert not list(tmp_path.glob("step_*/manifest.json"))


def test_in_place_needs_a_caller_that_waits(tmp_path: Path) -> None:
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    with pytest.raises(ValueError, match="in_place needs async_staging"):
        ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={}, in_place=True)
    ckpt.close()


class BatchNormNet(Strategy):
    """The state_dict part of a strategy, on a model whose forward changes buffers."""

    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)

    def setup(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def test_a_state_for_an_in_place_save_copies_the_buffers_alone() -> None:
    net = BatchNormNet()
    net.model(torch.randn(8, 4)).sum().backward()
    net.optimizer.step()
    live = net.state_dict_for_checkpoint()["model"]
    frozen = net.state_dict_for_checkpoint(copy_buffers=True)["model"]
    assert frozen.keys() == live.keys()
    buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for key in live:
        same = frozen[key].data_ptr() == live[key].data_ptr()
        assert same == (key not in buffers), key  # weights live, buffers copied
        assert torch.equal(frozen[key], live[key])
    net.model(torch.randn(8, 4) + 5)  # a forward moves the statistics, not the copies
    assert not torch.equal(frozen["1.running_mean"], live["1.running_mean"])


@pytest.mark.parametrize(
    ("async_save", "on_host", "last_write_s", "step_s", "expected"),
    [
        (True, True, 0.2, 1.0, True),
        (True, True, 0.5, 1.0, True),  # half a step: still hidden behind forward+backward
        (True, True, 0.51, 1.0, False),  # a slow disk: stage, the copy holds less
        (True, True, None, 1.0, False),  # no write timed yet (an attempt's first save)
        (True, False, 0.01, 1.0, False),  # a device's state is copied to the host anyway
        (False, True, 0.01, 1.0, False),  # sync saves block anyway
        (True, True, 0.01, 0.0, False),
    ],
)
def test_writes_in_place(
    async_save: bool, on_host: bool, last_write_s: float | None, step_s: float, expected: bool
) -> None:
    assert (
        writes_in_place(
            async_save=async_save, on_host=on_host, last_write_s=last_write_s, step_s=step_s
        )
        is expected
    )
