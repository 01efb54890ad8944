"""bench/all.py: every script under bench/ is a part (or a declared helper), and a part
whose script fails makes the whole run fail, so CI's quick run cannot pass over it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import all as bench_all

BENCH = Path(bench_all.__file__).resolve().parent


def test_every_script_under_bench_is_a_part_or_a_declared_helper() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if p.name != "__init__.py"}
    parts = {p.script for p in bench_all.PARTS}
    assert scripts - parts - bench_all.HELPERS - bench_all.NOT_BENCHES == set()
    # and nothing declared that is not there (a renamed script would leave a stale name)
    assert (parts | bench_all.HELPERS | bench_all.NOT_BENCHES) - scripts == set()


def test_every_part_has_a_quick_mode() -> None:
    assert all(p.quick for p in bench_all.PARTS)


def test_a_failing_part_fails_the_run_after_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = bench_all.Part("broken", "Broken", "no_such_bench.py", (), ("--quick",))
    # report_blocks.py run as a script does nothing and exits 0: a part that succeeds.
    fine = bench_all.Part("fine", "Fine", "report_blocks.py", (), ("--quick",))
    monkeypatch.setattr(bench_all, "BY_NAME", {"broken": broken, "fine": fine})
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "benchmarks.md"
    argv = ["all.py", "--quick", "--parts", "broken,fine", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        bench_all.main()
    assert str(exited.value.code).startswith("failed: broken")
    (record,) = tmp_path.glob("elastrain-bench-*/benchmarks.md")
    text = record.read_text()
    assert "**exited with 2**" in text  # python's "can't open file"
    assert "### Fine" in text  # the part after the broken one still ran
    assert not out.exists()  # --quick never writes the real document
