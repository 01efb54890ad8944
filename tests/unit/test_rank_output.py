"""A rank's process output in its log file (`elastrain.workers.rank_output`), in a fresh
interpreter whose fds 1 and 2 are its own: Python's prints, warnings, writes below Python
and a child process's output, in the order written, tagged with the rank; a flood stops at
the cap with its note; the fds are the process's own again afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from elastrain.workers.rank_output import captured_output

path = Path(sys.argv[1])
with captured_output(path, rank=3, limit=int(sys.argv[2])):
    print("one from print")
    os.write(1, b"two below Python\\n")
    warnings.warn("three, a warning")
    subprocess.run(["sh", "-c", "echo four from a child; echo five to stderr >&2"], check=True)
    logging.getLogger("elastrain.workers.loop").info("six from elastrain")
    print("seven" * int(sys.argv[3]), end="")
print("after, to the real stdout")
"""


def run(tmp_path: Path, limit: int = 1 << 20, flood: int = 1) -> tuple[list[str], str]:
    log = tmp_path / "logs" / "attempt-001-rank-3.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), str(limit), str(flood)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return log.read_text().splitlines(), done.stdout


def test_every_line_the_process_writes_is_in_the_ranks_log_in_order(tmp_path: Path) -> None:
    lines, stdout = run(tmp_path)
    said = [line.split("] ", 1)[1] for line in lines if "] " in line]
    assert said[:2] == ["INFO output: one from print", "INFO output: two below Python"]
    assert any("UserWarning: three, a warning" in s for s in said), said
    assert said.index("INFO output: four from a child") < said.index("INFO output: five to stderr")
    assert "INFO elastrain.workers.loop: six from elastrain" in said
    assert said[-1] == "INFO output: seven"  # the last line, with no newline of its own
    assert all("[rank 3]" in line for line in lines if "] " in line)
    # Copied to the fds it replaced (Ray's files), and those are the process's again after.
    assert "one from print" in stdout and "four from a child" in stdout
    assert "after, to the real stdout" in stdout
    assert not any("after" in line for line in lines)


def test_a_flood_stops_at_the_cap_with_a_note(tmp_path: Path) -> None:
    lines, _ = run(tmp_path, limit=4096, flood=100_000)
    text = "\n".join(lines)
    assert len(text.encode()) < 4096 + 400
    assert "reached 4096 bytes" in text and "one from print" in text
