"""Exporting a committed checkpoint as a Hugging Face model folder: which checkpoint, and
the conversion run in a child process. Pure Python (the API imports it).

The conversion itself (`elastrain.checkpoints.dcp.export`) needs torch and `transformers`, which the
control plane never loads: the API runs it as `python -m elastrain.checkpoints.dcp.export` in a
child process, which also hands the memory of the model's weights back to the system
when it ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastrain.checkpoints.catalog import CheckpointInfo, list_committed

#: Formats an export writes.
FORMATS = ("hf",)
#: The workloads a checkpoint can be exported from, as a Hugging Face model.
EXPORTABLE = ("hf_causal_lm", "gpt")
#: The child's exit status for an export that cannot be made (its stderr says why).
REFUSED = 3


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why."""


def pick_checkpoint(root: Path, step: int | None) -> CheckpointInfo:
    """The committed checkpoint of `step` (its newest attempt), or the newest one."""
    committed = list_committed(root)
    if not committed:
        raise ExportError("the job has no committed checkpoint yet")
    if step is None:
        return committed[0]
    for info in committed:
        if info.step == step:
            return info
    steps = ", ".join(str(s) for s in sorted({i.step for i in committed}))
    raise ExportError(f"step {step}: no committed checkpoint of that step (steps: {steps})")


def export_in_child(
    checkpoint: Path,
    workload: str,
    params: Mapping[str, Any],
    out: Path,
    *,
    model_folder: Path | None = None,
    timeout_s: float = 3600.0,
) -> None:
    """Run `elastrain.checkpoints.dcp.export` on `checkpoint` in a child process, writing `out`.
    Raises ExportError with the child's reason when it refuses, RuntimeError when it
    fails otherwise."""
    args = [
        sys.executable, "-m", "elastrain.checkpoints.dcp.export", str(checkpoint), workload,
        json.dumps(dict(params)), str(out),
    ]  # fmt: skip
    if model_folder is not None:
        args.append(str(model_folder))
    # The child imports this package from wherever this process did.
    here = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    if done.returncode == REFUSED:
        raise ExportError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
    if done.returncode != 0:
        raise RuntimeError(f"export of {checkpoint} failed: {done.stderr.strip()[-2000:]}")
