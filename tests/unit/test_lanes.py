"""`make test`'s lanes (tests/lanes.py): each lane's commands run in order, the lanes
side by side; every output is printed; a failure anywhere fails the whole."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.lanes import PYTEST_NO_TESTS, Command, Lane, failure_digest, lanes, run


def _py(code: str, ok: frozenset[int] = frozenset({0})) -> Command:
    return Command([sys.executable, "-c", code], ok)


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


def test_no_tests_collected_is_not_a_failure_of_pytest_but_is_of_anything_else(
    tmp_path: Path,
) -> None:
    exits_5 = "import sys; sys.exit(5)"
    pytest_like = _py(exits_5, frozenset({0, PYTEST_NO_TESTS}))
    assert run([Lane("a", [pytest_like], dict(os.environ))], tmp_path) == 0
    assert run([Lane("a", [_py(exits_5)], dict(os.environ))], tmp_path) == 5


def test_the_lanes_split_the_suite_by_marker_and_lint_runs_too(tmp_path: Path) -> None:
    by_name = {lane.name: lane for lane in lanes(["-q"], tmp_path)}
    selections = {
        name: [c.argv[c.argv.index("-m", 2) + 1] for c in lane.commands if "pytest" in c.argv]
        for name, lane in by_name.items()
    }
    # Complements: a test is in one selection or the other, never both, never neither.
    assert selections["ray"] == ["ray and not beside"]
    assert selections["rest"] == ["not ray or beside"]
    assert all(PYTEST_NO_TESTS in c.ok for c in by_name["rest"].commands if "pytest" in c.argv)
    assert by_name["rest"].commands[-1].argv[1:] == ["bench/all.py", "--quick"]
    assert by_name["rest"].env["RAY_TMPDIR"] == str(tmp_path / "ray")
    linters = [Path(c.argv[0]).name for c in by_name["lint"].commands]
    assert linters == ["ruff", "ruff", "mypy"]


def test_the_end_of_the_output_says_which_tests_failed_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CI log is often read from its end: after every lane, each failed command's
    digest (a real pytest's failed tests, their error lines) is printed again."""
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "def test_fine():\n    assert True\n\n"
        "def test_broken():\n    events = ['x' * 5000]\n"
        "    assert False, f'resume at 2 not reached; events={events}'\n"
    )
    failing = Command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)])
    noisy = _py("print('\\n'.join(f'line {i}' for i in range(100))); raise SystemExit(2)")
    status = run(
        [Lane("ray", [failing], dict(os.environ)), Lane("rest", [noisy], dict(os.environ))],
        tmp_path,
    )
    assert status != 0
    end = capsys.readouterr().out.split("== what failed (repeated from above)\n")[-1]
    assert "-- ray: python -m pytest" in end and "-- rest: python -c" in end
    assert "test_broken" in end and "resume at 2 not reached" in end
    assert "test_fine" not in end
    assert "test_sample.py:6: AssertionError" in end
    assert max(len(line) for line in end.splitlines()) < 1000  # the long events are cut
    assert "line 99" in end and "line 50" not in end  # not pytest: its last lines


def test_a_passing_run_prints_no_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([Lane("a", [_py("print('ok')")], dict(os.environ))], tmp_path) == 0
    assert "what failed" not in capsys.readouterr().out
    assert failure_digest("") == ""
