"""Structured logs: with ELASTRAIN_LOG_FORMAT=json every line is one JSON object, and lines
written while the scheduler works on a job carry its id, attempt and tenant."""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator

import pytest

from elastrain.service.logs import configure_logging, job_context, set_context


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_the_job_attempt_and_tenant(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    configure_logging("json")
    log = logging.getLogger("elastrain.scheduler")
    log.info("outside any job")
    with job_context(job_id=7, attempt=2, tenant="team-a"):
        log.warning("node %s lost", "n2")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("launch failed")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["message"] == "outside any job" and "job_id" not in lines[0]
    assert lines[1] | {"ts": None} == {
        "ts": None, "level": "warning", "logger": "elastrain.scheduler",
        "message": "node n2 lost", "job_id": 7, "attempt": 2, "tenant": "team-a",
    }  # fmt: skip
    assert "RuntimeError: boom" in lines[2]["exc"] and lines[2]["job_id"] == 7


def test_text_lines_end_with_the_context(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    configure_logging("text")

    def request() -> None:  # an API request: its own context, as asyncio gives each task
        set_context(tenant="ops")
        logging.getLogger("elastrain.api").info("hello")

    contextvars.copy_context().run(request)
    line = capsys.readouterr().err.strip()
    assert line.endswith("INFO elastrain.api: hello [tenant=ops]")
