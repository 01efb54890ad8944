"""A rank's log file stops at its cap with one note (`workers/log_cap.py`, issue 45 item 5):
the budget row by row, then the two writers on real files."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from elastrain.workers.log_cap import CappedFileHandler, CappedWriter, LogBudget, truncation_note


@pytest.mark.parametrize(
    ("used", "noted", "size", "expect"),
    [
        (0, False, 10, (10, False)),  # fits
        (90, False, 10, (10, False)),  # fits exactly
        (95, False, 10, (5, True)),  # the prefix that fits, then the note
        (100, False, 1, (0, True)),  # full: only the note
        (100, True, 1, (0, False)),  # noted: nothing more, ever
        (0, False, 1000, (100, True)),  # one write past the whole cap
    ],
)
def test_the_budget_writes_what_fits_then_the_note_once(
    used: int, noted: bool, size: int, expect: tuple[int, bool]
) -> None:
    assert LogBudget(limit=100, used=used, noted=noted).take(size) == expect


def test_a_writer_stops_at_its_cap_with_one_note(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "attempt-001-rank-0.log"
    writer = CappedWriter(path, limit=1000)
    for _ in range(500):
        writer.write(b"0123456789\n")
    writer.close()
    data = path.read_bytes()
    assert data.startswith(b"0123456789\n")
    assert data.count(truncation_note(1000)) == 1
    assert len(data) == 1000 + len(truncation_note(1000))
    # A second writer of the same file (a rank's later run) finds it full and adds nothing.
    again = CappedWriter(path, limit=1000)
    again.write(b"more\n")
    again.close()
    assert path.read_bytes() == data


def test_a_writer_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "operator.txt"
    victim.write_text("keep\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    os.symlink(victim, logs / "attempt-002-rank-0.log")  # planted by the job's code
    with pytest.raises(OSError):
        CappedWriter(logs / "attempt-002-rank-0.log")
    with pytest.raises(OSError):
        CappedFileHandler(logs / "attempt-002-rank-0.log")
    assert victim.read_text() == "keep\n"


def test_the_loops_handler_stops_at_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "attempt-001-rank-1.log"
    handler = CappedFileHandler(path, limit=4096)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("elastrain.test_log_cap")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for step in range(10_000):
            logger.warning("step %d loss %.3f", step, 1.0)
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = path.read_text()
    assert text.startswith("step 0 loss 1.000\n")
    assert text.count("[elastrain] this rank's log reached 4096 bytes") == 1
    assert len(text.encode()) == 4096 + len(truncation_note(4096))
