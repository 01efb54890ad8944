"""Where checkpoints live on disk. Pure Python (the control plane imports it).

A checkpoint of job step S made by attempt A lives in `<root>/step_{S:09d}-a{A}/`. The attempt
is part of the name so that a zombie attempt recomputing the same step never writes into the
folder of a newer attempt (and the newer attempt never overwrites the zombie's half-written
files): two writers never share a folder.

Inside a step folder:
- `__{rank}_{n}.distcp`: DCP shard data, one (or more) file per rank;
- `.metadata`: DCP's global metadata, written by the coordinator after every shard;
- `rank_{r}.extra.pt`: small per-rank extras (RNG states), written before the DCP save;
- `manifest.json`: written LAST; its presence is what makes the checkpoint committed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from elastrain.checkpoints.confined import is_real_dir

MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
# Temporary files (ours and DCP's `.metadata.tmp`) never belong to a checkpoint's file list.
TMP_MARKER = ".tmp"

_STEP_DIR_RE = re.compile(r"^step_(\d{9,})-a(\d+)$")


@dataclass(frozen=True, slots=True)
class StepDir:
    """A folder whose name parses as a step folder (committed or not)."""

    path: Path
    step: int
    attempt: int

    @property
    def sort_key(self) -> tuple[int, int]:
        # For one step, the higher attempt is the newer one (it superseded the lower).
        return (self.step, self.attempt)

    @property
    def committed(self) -> bool:
        return (self.path / MANIFEST_NAME).is_file()


def step_dir_name(step: int, attempt: int) -> str:
    if step < 0 or attempt < 0:
        raise ValueError(f"step and attempt must be >= 0, got step={step} attempt={attempt}")
    return f"step_{step:09d}-a{attempt}"


def step_dir(root: str | os.PathLike[str], step: int, attempt: int) -> Path:
    return Path(root) / step_dir_name(step, attempt)


def parse_step_dir_name(name: str) -> tuple[int, int] | None:
    """(step, attempt) for a step folder name, None for anything else."""
    match = _STEP_DIR_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def rank_extra_name(rank: int) -> str:
    return f"rank_{rank}.extra.pt"


def is_temporary(name: str) -> bool:
    return TMP_MARKER in name


def iter_step_dirs(root: str | os.PathLike[str]) -> list[StepDir]:
    """All step folders under root, newest first. A missing root is simply empty; files and
    folders with other names (junk, a user's notes) are ignored, and so are links: a job's
    code writes this folder, and a link it planted (to another job's checkpoint, another
    tenant's data, a folder out of the storage root) is neither loaded, exported nor
    deleted through. A root that is itself a link, or inside one, lists nothing."""
    if not (is_real_dir(Path(root)) and is_real_dir(Path(root).parent)):
        return []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[StepDir] = []
    for entry in entries:
        parsed = parse_step_dir_name(entry.name)
        if parsed is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:  # vanished between scandir and is_dir (concurrent retention)
            continue
        found.append(StepDir(path=Path(entry.path), step=parsed[0], attempt=parsed[1]))
    found.sort(key=lambda d: d.sort_key, reverse=True)
    return found
