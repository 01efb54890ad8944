"""Exporting a committed checkpoint as a Hugging Face model folder. Pure Python.

The conversion (`elastrain.checkpoints.dcp.export`) needs torch and `transformers` and
reads a job's files as hostile input, so an export task (`elastrain.workers.export_task`)
runs it in a child process holding none of its parent's secrets (`child_env`), whose
memory goes back to the system when it ends. The API then only packs the JSON and
safetensors files it wrote into a tar (`pack_export`), parsing none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastrain.checkpoints.catalog import CheckpointInfo, list_committed
from elastrain.checkpoints.confined import open_dir, remove_tree_at
from elastrain.contracts.files import ConfinedFileError, open_regular

#: The workloads a checkpoint can be exported from, as a Hugging Face model.
EXPORTABLE = ("hf_causal_lm", "gpt")
#: The child's exit status for an export that cannot be made (its stderr says why).
REFUSED = 3


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why."""


class ExportFailed(RuntimeError):
    """The export child failed otherwise (crashed, timed out). The message names no
    server path; `details` (the child's stderr) is for the log."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


#: The export child's environment: what Python, torch and transformers need to run, and
#: nothing else of the API's (its admin token, database URL, trackers' credentials).
_CHILD_VARIABLES = ("PATH", "LANG", "LC_ALL", "TMPDIR", "HOME", "PYTHONPATH", "VIRTUAL_ENV")


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
    trusted_root: Path | None = None,
    timeout_s: float = 3600.0,
) -> None:
    """Run `elastrain.checkpoints.dcp.export` on `checkpoint` in a child, writing `out`.
    `trusted_root`: a folder above `checkpoint` (the storage root) below which no link is
    followed. Raises ExportError with the child's reason, ExportFailed otherwise."""
    args = [
        sys.executable, "-m", "elastrain.checkpoints.dcp.export", str(checkpoint), workload,
        json.dumps(dict(params)), str(out), str(model_folder or ""), str(trusted_root or ""),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(os.environ),
            cwd=out.parent if out.parent.is_dir() else None,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ExportFailed(f"the export took longer than {timeout_s:.0f} s") from None
    if done.returncode == REFUSED:
        raise ExportError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
    if done.returncode != 0:
        raise ExportFailed(
            f"the export failed (exit status {done.returncode}); the server's log has the details",
            details=done.stderr.strip()[-2000:],
        )


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`_CHILD_VARIABLES` of `environ`, this package on the path, Hugging Face offline."""
    env = {name: environ[name] for name in _CHILD_VARIABLES if name in environ}
    here = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1")
    return env


#: What an export folder may hold: `save_pretrained`'s JSON and safetensors files (one, or
#: shards and their index), nothing that can carry code.
_EXPORTED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.(json|safetensors)")
#: The most files an export folder may hold.
MAX_EXPORTED_FILES = 256


def pack_export(trusted_root: Path, folder: Path, archive: Path, *, max_bytes: int) -> None:
    """Write the model folder `folder` (below the trusted `trusted_root`) as the tar
    `archive`, read as a job's bytes are: through no link, only regular JSON and
    safetensors files, at most `max_bytes` in all, nothing parsed. Raises ExportError."""
    try:
        fd = open_dir(trusted_root, folder)
    except ConfinedFileError as exc:
        raise ExportError(f"the export's folder: {exc}") from None
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries)
        if len(names) > MAX_EXPORTED_FILES:
            raise ExportError(
                f"the export wrote {len(names)} files, more than {MAX_EXPORTED_FILES}"
            )
        total = 0
        with tarfile.open(archive, "w") as tar:
            for name in names:
                if not _EXPORTED_NAME.fullmatch(name):
                    raise ExportError(f"the export wrote {name!r}: not a JSON or safetensors file")
                try:
                    opened = open_regular(name, dir_fd=fd)
                except ConfinedFileError as exc:
                    raise ExportError(str(exc)) from None
                except FileNotFoundError:
                    raise ExportError(f"{name} went away while it was read") from None
                with opened as f:
                    size = os.fstat(f.fileno()).st_size
                    total += size
                    if total > max_bytes:
                        raise ExportError(
                            f"the export wrote more than {max_bytes} bytes, more than its "
                            "checkpoint holds"
                        )
                    member = tarfile.TarInfo(name)
                    member.size, member.mode, member.mtime = size, 0o644, int(time.time())
                    try:
                        tar.addfile(member, f)
                    except OSError as exc:  # it shrank while read
                        raise ExportError(f"{name} changed while it was read") from exc
    finally:
        os.close(fd)


def remove_export(trusted_root: Path, folder: Path) -> None:
    """Delete the export folder `folder` (below `trusted_root`), through no link."""
    with contextlib.suppress(FileNotFoundError, ConfinedFileError):
        fd = open_dir(trusted_root, folder.parent)
        try:
            remove_tree_at(fd, folder.name)
        finally:
            os.close(fd)
