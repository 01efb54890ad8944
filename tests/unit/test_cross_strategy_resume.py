"""A checkpoint saved under one strategy resumes under another, at another world size, on
the same loss curve: what `strategy.kind: auto` relies on when a re-plan changes its mind."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.dist_utils import run_distributed
from tests.unit.test_workers_train import RTOL, STEPS, crcs, losses, make_spec, run_jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cross")
    ws2 = [
        ("whole", str(root / "whole"), make_spec("ddp", every=100), []),
        # DDP at 2 workers, stopped (checkpointed) after step 3 ...
        ("ddp-stop", str(root / "a"), make_spec("ddp", every=100), ["none", "none", "stop"]),
        ("fsdp-stop", str(root / "b"), make_spec("fsdp", every=100), ["none", "none", "stop"]),
    ]
    ws1 = [
        # ... resumed as FSDP on 1, and the other way round.
        ("fsdp-resume", str(root / "a"), make_spec("fsdp", every=100), []),
        ("ddp-resume", str(root / "b"), make_spec("ddp", every=100), []),
    ]
    out: dict[str, Any] = run_distributed(run_jobs, 2, ws2, timeout_s=600)[0]
    out.update(run_distributed(run_jobs, 1, ws1, timeout_s=600)[0])
    return out


@pytest.mark.parametrize(
    ("stopped", "resumed"), [("ddp-stop", "fsdp-resume"), ("fsdp-stop", "ddp-resume")]
)
def test_resume_under_another_strategy_and_size(
    runs: dict[str, Any], stopped: str, resumed: str
) -> None:
    first, second, whole = runs[stopped], runs[resumed], runs["whole"]
    assert second["result"].resumed_from_step == 3
    assert [m.step for m in second["metrics"]] == list(range(4, STEPS + 1))
    assert crcs(first) + crcs(second) == crcs(whole)
    assert losses(first) + losses(second) == pytest.approx(losses(whole), rel=RTOL)
