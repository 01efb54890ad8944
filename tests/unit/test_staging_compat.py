"""Async saves one after another must work on a torch whose stager empties its copy
table after every stage (torch 2.11 does with non-blocking device copies: on the GPU
check's image every async save after a job's first failed with KeyError(<class
'type'>)). The older behaviour is made here on 2.13 by closing the StateDictStager after
each stage, as 2.11's `DefaultStager._stage` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from elastrain.checkpoints.dcp.checkpointer import ShardedCheckpointer
from elastrain.checkpoints.manifest import read_manifest
from tests.unit.test_checkpoints_dcp import build, ckpt_state


@pytest.fixture
def stager_of_torch_2_11(monkeypatch: pytest.MonkeyPatch) -> None:
    original = DefaultStager._stage

    def stage_then_close(self: DefaultStager, state: Any, **kwargs: Any) -> Any:
        staged = original(self, state, **kwargs)
        self._state_dict_stager.close()  # what 2.11 does after every stage
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


def test_an_emptied_stager_fails_the_next_stage(stager_of_torch_2_11: None) -> None:
    stager = DefaultStager(StagingOptions(False, False, True, False))  # as on a CPU
    try:
        stager.stage({"w": torch.ones(2)}).result()
        with pytest.raises(KeyError):
            stager.stage({"w": torch.ones(2)}).result()
    finally:
        stager.close()


def test_async_saves_after_the_first_commit(stager_of_torch_2_11: None, tmp_path: Path) -> None:
    model, optim = build("plain")
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    for step in range(1, 4):
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
        ckpt.wait_staged()
    assert [c.step for c in ckpt.close()] == [1, 2, 3]
    assert read_manifest(tmp_path / "step_000000003-a0").step == 3
