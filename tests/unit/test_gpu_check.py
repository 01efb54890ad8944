"""bench/gpu_check.py's parts that run where there is no GPU: it says it measured nothing,
joins wheels that travelled in pieces, and its report reads right from partial results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import gpu_check


def test_without_a_gpu_it_measures_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check, "cuda_devices", lambda: None)
    out = tmp_path / "bench-gpu.md"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick", "--out", str(out)])
    assert gpu_check.main() == 0
    assert "no GPU: skipped, nothing measured" in capsys.readouterr().out
    assert "skipped, nothing measured" in out.read_text()
    # Not quick (`make gpu-check`, `make bench`): the real document is left as it is.
    out.write_text("earlier figures")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(out)])
    assert gpu_check.main() == 0
    assert out.read_text() == "earlier figures"


def test_wheels_in_pieces_are_joined_across_folders(tmp_path: Path) -> None:
    a, b, into = tmp_path / "a", tmp_path / "b", tmp_path / "into"
    for d in (a, b, into):
        d.mkdir()
    (a / "big-1.0-py3-none-any.whl.part00").write_bytes(b"first-")
    (b / "big-1.0-py3-none-any.whl.part01").write_bytes(b"second")
    (b / "small-2.0-py3-none-any.whl").write_bytes(b"whole")
    wheels = gpu_check.gather_wheels([b, a], into)
    assert [w.name for w in wheels] == ["big-1.0-py3-none-any.whl", "small-2.0-py3-none-any.whl"]
    assert wheels[0].read_bytes() == b"first-second"


def test_the_report_shows_what_ran_and_what_failed() -> None:
    report = gpu_check.Report(quick=False)
    report.throughput += [
        ("ddp bf16", "plain", 1000.0, 0.40),
        ("ddp bf16", "service", 990.0, 0.396),
    ]
    report.throughput.append(("fsdp bf16", "plain", 800.0, None))
    report.timelines.append(("ddp bf16", "submitted", {"placed": 0.2, "total": 1.5}, "fresh"))
    report.check("ddp bf16: the first start ran in warm GPU processes", True, "(pids [7])")
    report.failures.append("service: fsdp bf16 job: TimeoutError: not within 300 s")
    text = gpu_check.render(report, "python bench/gpu_check.py")
    assert "| ddp bf16 | 1,000 | 990 | 0.990 | 40.0% | 39.6% |" in text
    assert "| fsdp bf16 | 800 |  |  |  |  |" in text  # the service's run never came
    assert "| ddp bf16 | submitted |  | 0.20 |" in text
    assert "- service: fsdp bf16 job: TimeoutError" in text
