"""`ELASTRAIN_PROFILE_STEPS`: the setting's parse, and a profile written for the steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastrain.workers.profiling import StepProfiler, steps_of


@pytest.mark.parametrize(
    ("setting", "span"), [(None, None), ("", None), ("7", (7, 7)), ("20:24", (20, 24))]
)
def test_the_setting_names_the_steps(setting: str | None, span: tuple[int, int] | None) -> None:
    assert steps_of(setting) == span


@pytest.mark.parametrize("setting", ["a:b", "5:2", "0:3", "1:x"])
def test_a_malformed_setting_is_an_error(setting: str) -> None:
    with pytest.raises(ValueError, match="ELASTRAIN_PROFILE_STEPS"):
        steps_of(setting)


def test_the_steps_named_are_profiled_and_written(tmp_path: Path) -> None:
    out = tmp_path / "profile" / "attempt1-rank0.txt"
    profiler = StepProfiler(out, (2, 3))
    w = torch.ones(64, 64)
    for step in range(1, 5):
        profiler.before(step)
        torch.mm(w, w)
        profiler.after(step)
        assert out.exists() == (step >= 3)
    assert "aten::mm" in out.read_text()


def test_unset_writes_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler(tmp_path / "p.txt", None)
    profiler.before(1)
    profiler.after(1)
    assert not (tmp_path / "p.txt").exists()
