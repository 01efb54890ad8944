"""Digests and verification of committed checkpoints. Pure Python.

Verification is cheap-first: names and sizes (a stat per file, catches truncation and
missing shards) before a digest of every byte (catches bit rot and overwritten data).
Each file is checked with the algorithm its manifest entry names
(`elastrain.checkpoints.digest`). At save time the shards' digests are taken while they
are written (`elastrain.checkpoints.dcp.writer`); only files without one are read back.
At load time the shards are checked by the ranks that read them, while they read them
(`elastrain.checkpoints.dcp.reader`), so the DCP loader leaves them out here (`digests_of`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, new_hasher
from elastrain.checkpoints.layout import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    is_temporary,
    parse_step_dir_name,
)
from elastrain.checkpoints.manifest import FileEntry, Manifest, ManifestError, read_manifest

# Large enough that the per-call overhead vanishes, small enough to stay out of the way of
# training memory. hashlib and xxhash release the GIL for buffers this size, so a
# background digest does not stall the training thread.
CHUNK_BYTES = 8 * 1024 * 1024


class CorruptCheckpoint(Exception):
    """A checkpoint folder that must not be loaded, and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason

    def __reduce__(self) -> tuple[type[CorruptCheckpoint], tuple[Path, str]]:
        # Raised in a DCP load, it travels to every rank pickled (the load's all-gather of
        # failures): rebuilt from its fields, not from the formatted message.
        return (type(self), (self.path, self.reason))


def digest_file(path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a file by `algorithm`, read in chunks (never the whole file in memory)."""
    h = new_hasher(algorithm)
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


def digest_files(root: Path, algorithms: Mapping[str, str]) -> dict[str, str]:
    """Hex digest of each named file under root by its algorithm (name -> algorithm). One
    after another: the shards are hashed as they are written and as they are read
    (`elastrain.checkpoints.dcp`), so what is hashed here is small (`.metadata`, the rank
    extras) unless a streamed digest was given up."""
    return {name: digest_file(root / name, algorithm) for name, algorithm in algorithms.items()}


def describe_files(
    ckpt_dir: str | os.PathLike[str],
    known: Mapping[str, FileEntry] | None = None,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
) -> dict[str, FileEntry]:
    """Size and digest (by `algorithm`) of every checkpoint file, for the manifest.

    `known`: digests taken while the files were written (`elastrain.checkpoints.dcp.writer`). One is
    used only when the file's size on disk is the number of bytes that were hashed and it
    is by `algorithm`; every other file (and any file `known` does not name) is hashed
    from disk."""
    root = Path(ckpt_dir)
    known = known or {}
    entries: dict[str, FileEntry] = {}
    to_hash: dict[str, str] = {}
    for name in checkpoint_files(root):
        size = (root / name).stat().st_size
        streamed = known.get(name)
        if streamed is not None and streamed["size"] == size and streamed["algorithm"] == algorithm:
            entries[name] = FileEntry(size=size, digest=streamed["digest"], algorithm=algorithm)
        else:
            to_hash[name] = algorithm
    for name, digest in digest_files(root, to_hash).items():
        size = (root / name).stat().st_size
        entries[name] = FileEntry(size=size, digest=digest, algorithm=algorithm)
    return dict(sorted(entries.items()))


def verify(
    ckpt_dir: str | os.PathLike[str],
    manifest: Manifest | None = None,
    *,
    check_digests: bool = True,
    digests_of: Collection[str] | None = None,
) -> Manifest:
    """Raise CorruptCheckpoint naming the first problem found; return the manifest.

    With `manifest=None` the manifest is read from the folder (missing/unparseable is a
    CorruptCheckpoint too). Every file's name and size is checked; with `check_digests`,
    the digest of every file, or only of those `digests_of` names (the others' are checked
    by whoever reads them: `elastrain.checkpoints.dcp.reader`).
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
    to_check = {
        name: entry["algorithm"]
        for name, entry in manifest.files.items()
        if digests_of is None or name in digests_of
    }
    actual_digests = digest_files(root, to_check)
    for name in sorted(to_check):
        mismatch = digest_mismatch(name, manifest.files[name], actual_digests[name])
        if mismatch is not None:
            raise CorruptCheckpoint(root, mismatch)
    return manifest


def digest_mismatch(name: str, entry: FileEntry, actual: str) -> str | None:
    """Why file `name` whose digest is `actual` is not what its manifest entry says, or
    None when it is."""
    if actual == entry["digest"]:
        return None
    return (
        f"digest mismatch: {name} {entry['algorithm']} {actual[:12]}..., "
        f"manifest {entry['digest'][:12]}..."
    )
