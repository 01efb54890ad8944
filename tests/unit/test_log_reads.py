"""What the API reads of a job's logs folder, which the job's code writes (`api/logs.py`,
issue 45 item 5): the ranks' own files first and at most N of them, never through a link,
never blocked by a FIFO, never more bytes than asked."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from elastrain.api.logs import _read_from, read_logs


def test_the_ranks_files_come_first_and_the_listing_stops_at_its_bound(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"attempt-001-aaa-{i:02d}.log").write_text("junk\n")
    for rank in range(3):
        (tmp_path / f"attempt-001-rank-{rank}.log").write_text(f"rank {rank}\n")
    chunk = read_logs(tmp_path, max_files=5, max_bytes=1 << 16)
    assert chunk.files[:3] == [f"attempt-001-rank-{r}.log" for r in range(3)]
    assert len(chunk.files) == 5
    assert "ELASTRAIN_LOG_FILES_PER_JOB" in chunk.text.splitlines()[0]


def test_links_and_fifos_are_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("operator's secret\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "attempt-001-rank-0.log").write_text("ok\n")
    os.symlink(secret, logs / "attempt-001-rank-1.log")
    os.mkfifo(logs / "attempt-001-rank-2.log")
    done = threading.Event()
    result: list[str] = []

    def read() -> None:
        result.append(read_logs(logs).text)
        # A FIFO put where the listing saw a file: refused at once, not waited on.
        result.append(_read_from(logs / "attempt-001-rank-2.log", 0, 100).decode())
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), "a FIFO held the read"
    assert result[0] == "ok\n"  # the one regular file, alone (and so untagged)
    assert result[1] == ""


def test_a_huge_sparse_file_is_read_a_page_at_a_time(tmp_path: Path) -> None:
    with open(tmp_path / "attempt-001-rank-0.log", "wb") as f:
        f.truncate(16 << 30)
    chunk = read_logs(tmp_path, max_bytes=4096)
    assert 0 < len(chunk.text.encode()) <= 4096 + 64  # the page, and its rank tag
