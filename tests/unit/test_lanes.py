"""`make test`'s two lanes (tests/lanes.py): each lane's commands run in order, the lanes
side by side; every output is printed; a failure anywhere fails the whole."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.lanes import Lane, run


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_lanes_run_side_by_side_in_order_and_the_first_failure_is_the_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marks = tmp_path / "marks"
    slow = _py(f"import time; time.sleep(1); open({str(marks)!r}, 'a').write('slow ')")
    fast = _py(f"open({str(marks)!r}, 'a').write('fast ')")
    fails = _py("import sys; print('broken here'); sys.exit(3)")
    after = _py(f"open({str(marks)!r}, 'a').write('after ')")
    status = run(
        [Lane("a", [slow], dict(os.environ)), Lane("b", [fast, fails, after], dict(os.environ))],
        tmp_path,
    )
    assert status == 3
    # Lane b ran while lane a's command was still sleeping, and ran on past its failure.
    assert marks.read_text().split() == ["fast", "after", "slow"]
    out = capsys.readouterr().out
    assert "broken here" in out and "== b: exit 3" in out


def test_no_tests_collected_is_not_a_failure(tmp_path: Path) -> None:
    assert run([Lane("a", [_py("import sys; sys.exit(5)")], dict(os.environ))], tmp_path) == 0
