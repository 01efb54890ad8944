"""Test data: valid job specs to start from, one override away from the case under test."""

from __future__ import annotations

import copy
import io
import zipfile
from collections.abc import Mapping
from typing import Any

_BASE: dict[str, Any] = {
    "name": "gpt-tiny",
    "workload": {"name": "synthetic", "params": {}},
    "scaling": {"min_workers": 1, "max_workers": 2},
    "training": {"global_batch_size": 32, "micro_batch_size": 8, "max_steps": 50},
    "labels": {"team": "nlp"},
}

_MERGED = {"strategy", "scaling", "training", "checkpoint", "failure"}


def spec_dict(**overrides: Any) -> dict[str, Any]:
    """A valid spec; `scaling={"field": v}` (and the other settings sections) merge into the
    section, any other key (`workload`, `labels`, `name`...) replaces."""
    spec = copy.deepcopy(_BASE)
    for key, value in overrides.items():
        if key in _MERGED and isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def a_zip(files: Mapping[str, bytes | str], *, level: int | None = None) -> bytes:
    """A package upload's body: a zip of `files` (path -> content)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()
