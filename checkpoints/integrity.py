"""Digests and verification of committed checkpoints. Pure Python.

Verification is cheap-first: names and sizes (a stat per file, catches truncation and
missing shards) before sha256 of every byte (catches bit rot and overwritten data).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from checkpoints.layout import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    is_temporary,
    parse_step_dir_name,
)
from checkpoints.manifest import FileEntry, Manifest, ManifestError, read_manifest

# Large enough that the per-call overhead vanishes, small enough to stay out of the way of
# training memory. hashlib releases the GIL for buffers this size, so a background digest
# does not stall the training thread.
CHUNK_BYTES = 8 * 1024 * 1024


class CorruptCheckpoint(Exception):
    """A checkpoint folder that must not be loaded, and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def digest_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def checkpoint_files(ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """Names (relative, '/'-separated) of the files that make up a checkpoint: everything
    in the folder but the manifest itself and temporary files."""
    root = Path(ckpt_dir)
    names: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            if filename == MANIFEST_NAME or is_temporary(filename):
                continue
            names.append((Path(dirpath) / filename).relative_to(root).as_posix())
    return sorted(names)


def describe_files(ckpt_dir: str | os.PathLike[str]) -> dict[str, FileEntry]:
    """Size and digest of every checkpoint file, for the manifest."""
    root = Path(ckpt_dir)
    entries: dict[str, FileEntry] = {}
    for name in checkpoint_files(root):
        path = root / name
        entries[name] = FileEntry(size=path.stat().st_size, sha256=digest_file(path))
    return entries


def verify(
    ckpt_dir: str | os.PathLike[str],
    manifest: Manifest | None = None,
    *,
    check_digests: bool = True,
) -> Manifest:
    """Raise CorruptCheckpoint naming the first problem found; return the manifest.

    With `manifest=None` the manifest is read from the folder (missing/unparseable is a
    CorruptCheckpoint too).
    """
    root = Path(ckpt_dir)
    if manifest is None:
        try:
            manifest = read_manifest(root)
        except ManifestError as e:
            raise CorruptCheckpoint(root, e.reason) from e

    parsed = parse_step_dir_name(root.name)
    if parsed is not None and parsed != (manifest.step, manifest.attempt):
        # A folder copied or renamed by hand: its content is not what its name promises.
        raise CorruptCheckpoint(
            root,
            f"manifest says step {manifest.step} attempt {manifest.attempt}, "
            f"folder name says step {parsed[0]} attempt {parsed[1]}",
        )
    if DCP_METADATA_NAME not in manifest.files:
        raise CorruptCheckpoint(root, f"manifest lists no DCP {DCP_METADATA_NAME}")

    # Pass 1: existence and sizes (cheap).
    for name, entry in sorted(manifest.files.items()):
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(root, f"missing file {name}") from None
        if size != entry["size"]:
            kind = "truncated" if size < entry["size"] else "size mismatch"
            raise CorruptCheckpoint(
                root, f"{kind}: {name} is {size} bytes, manifest says {entry['size']}"
            )
    if not check_digests:
        return manifest
    # Pass 2: content.
    for name, entry in sorted(manifest.files.items()):
        actual = digest_file(root / name)
        if actual != entry["sha256"]:
            raise CorruptCheckpoint(
                root,
                f"digest mismatch: {name} sha256 {actual[:12]}..., manifest {entry['sha256'][:12]}...",
            )
    return manifest
