"""Error responses: every failure is JSON with a human `detail`/`message`, never a traceback.

Validation errors keep FastAPI's 422 shape (`detail`: a list of `{loc, msg, type}`) and add
`message`, one line per problem that starts with the field's dotted path, e.g.
`scaling.min_workers (3) must be <= scaling.max_workers (2)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError

from elastrain.api.logs import BadCursor
from elastrain.contracts.spec import JobSpec
from elastrain.service.jobs import JobNotFound
from elastrain.service.states import IllegalTransition

log = logging.getLogger("elastrain.api")

_VALUE_ERROR_PREFIXES = ("Value error, ", "Assertion failed, ")


def invalid(loc: tuple[str | int, ...], msg: str) -> RequestValidationError:
    """A 422 in the project's shape, for a check the models cannot make themselves (it
    needs the database, the storage root or the settings)."""
    return RequestValidationError([{"loc": loc, "msg": msg, "type": "value_error"}])


class Conflict(Exception):
    """The job is in a state where the request makes no sense (HTTP 409)."""


class TooMany(Exception):
    """A limit of the service is reached (HTTP 429): the message names the limit and the
    setting that sets it; `retry_after_s` goes in the Retry-After header."""

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """What the request needs is not there in this process (HTTP 503): the message says
    what."""


def _field_path(loc: Sequence[Any]) -> str:
    # Drop where the value came from ("body", "query", ...).
    parts = [str(p) for p in loc[1:]]
    return ".".join(parts) if parts else (str(loc[0]) if loc else "request")


def _allowed_fields(loc: Sequence[Any]) -> list[str] | None:
    """The field names allowed at `loc` inside a JobSpec body, for 'unknown field' errors."""
    if not loc or loc[0] != "body":
        return None
    model: type[BaseModel] = JobSpec
    for part in loc[1:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return list(model.model_fields)


def _humanize(error: dict[str, Any]) -> str:
    loc = tuple(error.get("loc", ()))
    path = _field_path(loc)
    msg = str(error.get("msg", "invalid"))
    for prefix in _VALUE_ERROR_PREFIXES:
        msg = msg.removeprefix(prefix)
    kind = error.get("type")
    if loc and loc[-1] == "[key]":  # a dict key (a label name) is wrong, not its value
        parent = _field_path(loc[:-2]) if len(loc) > 2 else "body"
        return f"{parent}: key {str(loc[-2])[:70]!r}: {msg}"
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "")
        return (
            f"request body: not valid JSON ({reason})" if reason else "request body: not valid JSON"
        )
    if kind == "missing" and loc == ("body",):
        return "request body: a JSON object is required"
    if kind == "model_attributes_type" and loc == ("body",):
        return "request body: must be a JSON object"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc)
        hint = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return f"{path}: unknown field{hint}"
    # Model validators already start their message with the field path; don't say it twice.
    # (A whole-body validator's loc is just ("body",): its message names the fields.)
    head = path.split(".")[0]
    if loc == ("body",) or any(msg.startswith(head + sep) for sep in (".", ":", " ")):
        return msg
    return f"{path}: {msg}"


def validation_payload(errors: Sequence[Any]) -> dict[str, Any]:
    detail = []
    for error in errors:
        detail.append(
            {
                "loc": list(error.get("loc", ())),
                "msg": _humanize(error),
                "type": error.get("type", "value_error"),
            }
        )
    return {"detail": detail, "message": "; ".join(d["msg"] for d in detail) or "invalid request"}


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(
        validation_payload(exc.errors()), status_code=status.HTTP_422_UNPROCESSABLE_CONTENT
    )


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_404_NOT_FOUND)


async def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_409_CONFLICT)


async def _too_many(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, TooMany)
    return JSONResponse(
        {"detail": str(exc)},
        status_code=status.HTTP_429_TOO_MANY_REQUESTS,
        headers={"Retry-After": str(exc.retry_after_s)},
    )


async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


async def _bad_cursor(_: Request, exc: Exception) -> JSONResponse:
    payload = validation_payload(
        [{"loc": ("query", "offset"), "msg": str(exc), "type": "value_error"}]
    )
    return JSONResponse(payload, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def _database_down(request: Request, exc: Exception) -> JSONResponse:
    log.error("database error on %s %s: %s", request.method, request.url.path, exc)
    return JSONResponse(
        {"detail": "the database is unavailable; try again shortly"},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the server log only: it may hold paths, SQL or secrets.
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        {"detail": "internal server error"}, status_code=status.HTTP_500_INTERNAL_SERVER_ERROR
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(IllegalTransition, _conflict)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(TooMany, _too_many)
    app.add_exception_handler(Unavailable, _unavailable)
    app.add_exception_handler(BadCursor, _bad_cursor)
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(Exception, _unexpected)
