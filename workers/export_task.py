"""The export's conversion, run as a Ray task on the cluster rather than in the API.

A checkpoint's every byte is its job's to write. Reading it (DCP's pickled metadata,
torch's tensor records, a model folder's config) is the job's own business, so it
happens where the job's code runs, with the rights its ranks have: a Ray task of the
workers' user, which can already do whatever a planted file could make it do. It writes
only a safe format (`model.safetensors` and JSON, `elastrain.checkpoints.dcp.export`) that
the API streams without parsing (`api/routes/export.py`). The task still reads the
checkpoint as hostile input (`elastrain.checkpoints.dcp.untrusted`), in a child process
with no secrets of the worker's (`export_in_child`), which also hands the weights' memory
back when it ends: a Ray worker process is reused.

No torch at import: the control plane imports this module to name the task.
"""

from __future__ import annotations

import json
from pathlib import Path

from elastrain.checkpoints.confined import plain_name
from elastrain.checkpoints.export import ExportError, ExportFailed, export_in_child
from elastrain.contracts.runtime import ExportOutcome, ExportRequest


def run_export(request: ExportRequest) -> ExportOutcome:
    """Convert `request.checkpoint` into `request.out` (both under the storage root)."""
    root = Path(request.storage_path)
    try:
        checkpoint = _below(root, request.checkpoint)
        out = _below(root, request.out)
        folder = _below(root, request.model_folder) if request.model_folder else None
        out.parent.mkdir(parents=True, exist_ok=True)
        export_in_child(
            checkpoint, request.workload, json.loads(request.params_json), out,
            model_folder=folder, trusted_root=root, timeout_s=request.timeout_s,
        )  # fmt: skip
    except ExportError as exc:
        return ExportOutcome(refused=str(exc))
    except ExportFailed as exc:
        return ExportOutcome(failed=str(exc), details=exc.details)
    return ExportOutcome()


def _below(root: Path, relative: str) -> Path:
    """`root / relative`, where `relative` is plain names only (no `..`, no absolute)."""
    parts = Path(relative).parts
    if not parts or not all(plain_name(p) for p in parts):
        raise ExportError(f"{relative!r} is not a path below the storage root")
    return root.joinpath(*parts)
