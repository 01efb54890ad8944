"""Bounds on what clients send: pure checks, shared by the spec models and the API.

Every value a request stores must also be readable back, by every database we support and
by every client: no NUL (PostgreSQL's JSONB and text refuse it), no terminal escapes in
what a CLI prints, no nesting deep enough to exhaust a parser's recursion, no number a
64-bit column or a JSON reader cannot hold.
"""

from __future__ import annotations

import json
import math
import sys
import unicodedata
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationInfo

#: How deep `workload.params` may nest (a dict in a list in a dict... counts 3).
MAX_PARAMS_DEPTH = 16
#: Their size once serialised: parameters, not data (data lives on shared storage).
MAX_PARAMS_BYTES = 64 * 1024
#: Integers anywhere in a stored document: what a signed 64-bit column or a JSON reader
#: that parses into int64/double still holds exactly.
MAX_INT = 2**63 - 1
#: The service's own top-level packages (`elastrain.contracts.packages.OWN_PACKAGES`): never an
#: entrypoint. The built-in workloads are reached by name only (`workload.name`), where
#: their params and data paths are checked; their module's other functions not at all.
OWN_PACKAGES = frozenset({"api", "checkpoints", "contracts", "service", "workers"})


def control_characters(text: str) -> list[str]:
    """The control characters (Unicode category Cc/Cf, e.g. NUL, ESC, bidi overrides) in
    `text`, as escapes for an error message."""
    found = []
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf") and repr(ch)[1:-1] not in found:
            found.append(repr(ch)[1:-1])
    return found


#: Validation context for specs read back from the database: they were accepted once, and
#: a bound added since must not make them unreadable (the scheduler and the API read
#: every job), so the bounds below skip them.
STORED = {"stored": True}


def is_stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def no_control_characters(text: str, info: ValidationInfo) -> str:
    """A validator: refuse `text` if it holds control characters."""
    if is_stored(info):
        return text
    bad = control_characters(text)
    if bad:
        raise ValueError(f"must not contain control characters (found {', '.join(bad[:5])})")
    return text


def check_json_document(value: Any, *, max_depth: int, max_bytes: int) -> None:
    """Raise ValueError (saying what is wrong and where) unless `value` is plain JSON data
    within the bounds: depth, serialised size, finite numbers, 64-bit integers, no NUL."""
    _walk(value, path="", depth=0, max_depth=max_depth)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > max_bytes:
        raise ValueError(f"is {size} bytes as JSON; the limit is {max_bytes}")


def _walk(value: Any, *, path: str, depth: int, max_depth: int) -> None:
    where = f" at {path}" if path else ""
    if depth > max_depth:
        raise ValueError(f"nests deeper than {max_depth} levels{where}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"keys must be strings{where}")
            if "\x00" in key:
                raise ValueError(f"a key{where} contains NUL")
            inner = f"{path}.{key}" if path else key
            _walk(item, path=inner[:200], depth=depth + 1, max_depth=max_depth)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(item, path=f"{path}[{i}]"[:200], depth=depth + 1, max_depth=max_depth)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"integer{where} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"number{where} must be finite (no NaN or Infinity)")
    elif isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"string{where} contains NUL")
    else:
        raise ValueError(f"{type(value).__name__}{where} is not JSON data")


def in_standard_library(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def private_part(entrypoint: str) -> str | None:
    """The first private name (starting with '_') of 'package.module:factory', or None:
    only public factories are entrypoints, never a module's internal helpers."""
    module, _, attr = entrypoint.partition(":")
    return next((p for p in (*module.split("."), attr) if p.startswith("_")), None)


def entrypoint_refusal(entrypoint: str, allowed_prefixes: Iterable[str]) -> str | None:
    """Why a custom entrypoint may not run here, or None when it may.

    A workload is code that runs on the cluster: an entrypoint such as `os:system` with
    `params: {command: ...}` would run any command. Only public factories of the module
    prefixes the operator lists are allowed; never the standard library, and never the
    service's own modules (the built-in workloads are named: `workload.name`).
    """
    module = entrypoint.partition(":")[0]
    if in_standard_library(module):
        return f"module {module!r} is in the Python standard library; workloads cannot come from it"
    if module.split(".")[0] in OWN_PACKAGES:
        return (
            f"module {module!r} is elastrain's own; a built-in workload is given by name "
            "(workload.name: gpt or synthetic), where its params are checked"
        )
    if (private := private_part(entrypoint)) is not None:
        return f"{private!r} is private (it starts with '_'); only public factories can run"
    prefixes = tuple(allowed_prefixes)
    if any(module == p or module.startswith(p + ".") for p in prefixes):
        return None
    listed = ", ".join(repr(p) for p in prefixes) or "none"
    return (
        f"module {module!r} is not allowed on this service (allowed module prefixes: "
        f"{listed}); the operator lists them in ELASTRAIN_ALLOWED_ENTRYPOINTS"
    )
