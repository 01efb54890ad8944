"""The control plane's logs: text for people, or one JSON object a line for machines.

Lines about a job carry its id, attempt and tenant: the scheduler sets them around the work
on each job (`job_context`), the API sets the tenant of each request. A JSON line is
`{"ts", "level", "logger", "message", "job_id"?, "attempt"?, "tenant"?, "exc"?}`, so that
Loki/Elasticsearch/`jq` can select every line of one job or one tenant.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

_CONTEXT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "elastrain_log_context", default=None
)
CONTEXT_KEYS = ("job_id", "attempt", "tenant")


@contextmanager
def job_context(**fields: Any) -> Iterator[None]:
    """Every log line inside carries `fields` (job_id, attempt, tenant)."""
    token = _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def set_context(**fields: Any) -> None:
    """Add `fields` for the rest of the current task (an API request's tenant)."""
    _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_CONTEXT.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        tags = [f"{k}={getattr(record, k)}" for k in CONTEXT_KEYS if hasattr(record, k)]
        return f"{text} [{' '.join(tags)}]" if tags else text


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Route every logger (ours, uvicorn's, alembic's) through one handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
