"""Where checkpoints live on disk. Pure Python.

Step S by attempt A lives in `<root>/step_{S:09d}-a{A}/`: with the attempt in the name, a
zombie attempt recomputing a step and its successor never share a folder. Inside: DCP's
`__{rank}_{n}.distcp` shards and `.metadata`, `rank_{r}.extra.pt` (RNG states), and
`manifest.json`, written last: its presence makes the checkpoint committed.
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
    """All step folders under root, newest first; other names are ignored, and so are
    links: one a job planted (to another job's checkpoint or tenant's data) is never
    loaded, exported nor deleted through. A root that is, or is in, a link lists nothing."""
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
