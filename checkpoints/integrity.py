"""Digests and verification of committed checkpoints. Pure Python.

Cheap first: names and sizes (truncation, missing shards) before every byte's digest (bit
rot, overwrites), by the algorithm each manifest entry names. Shards are digested while
written (`dcp.writer`) and checked by the ranks reading them (`dcp.reader`), so the
loader leaves them out here (`digests_of`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import BinaryIO

from elastrain.checkpoints.layout import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    is_temporary,
    parse_step_dir_name,
)
from elastrain.checkpoints.manifest import (
    DEFAULT_ALGORITHM,
    FileEntry,
    Manifest,
    ManifestError,
    new_hasher,
    read_manifest,
)

# hashlib and xxhash release the GIL for buffers this size: a background digest does not
# stall the training thread.
CHUNK_BYTES = 8 * 1024 * 1024


class CorruptCheckpoint(Exception):
    """A checkpoint folder that must not be loaded, and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason

    def __reduce__(self) -> tuple[type[CorruptCheckpoint], tuple[Path, str]]:
        # DCP's load pickles it to every rank: rebuilt from its fields, not the message.
        return (type(self), (self.path, self.reason))


def digest_stream(f: BinaryIO, algorithm: str) -> str:
    """Hex digest by `algorithm` of what is left of an open file, read in chunks."""
    h = new_hasher(algorithm)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    while n := f.readinto(buf):  # type: ignore[attr-defined]  # not in BinaryIO's stub
        h.update(view[:n])
    return h.hexdigest()


def digest_file(path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM) -> str:
    with open(path, "rb", buffering=0) as f:
        return digest_stream(f, algorithm)


def describe_files(
    ckpt_dir: str | os.PathLike[str],
    known: Mapping[str, FileEntry] | None = None,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
) -> dict[str, FileEntry]:
    """Size and digest of every file of the checkpoint but the manifest and temporary
    files. `known`: digests taken while writing, used only when the size on disk is the
    bytes hashed, by `algorithm`; other files are hashed from disk."""
    root = Path(ckpt_dir)
    known = known or {}
    entries: dict[str, FileEntry] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            if filename == MANIFEST_NAME or is_temporary(filename):
                continue
            path = Path(dirpath) / filename
            name = path.relative_to(root).as_posix()
            size = path.stat().st_size
            entry = known.get(name)
            if entry is None or (entry["size"], entry["algorithm"]) != (size, algorithm):
                entry = FileEntry(
                    size=size, digest=digest_file(path, algorithm), algorithm=algorithm
                )
            entries[name] = entry
    return dict(sorted(entries.items()))


def verify(
    ckpt_dir: str | os.PathLike[str],
    manifest: Manifest | None = None,
    *,
    digests_of: Collection[str] | None = None,
) -> Manifest:
    """Raise CorruptCheckpoint naming the first problem; return the manifest (read from
    the folder when None). Checks every file's size, then the digests of all of them or
    of those `digests_of` names."""
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
    for name, entry in sorted(manifest.files.items()):
        if digests_of is None or name in digests_of:
            mismatch = digest_mismatch(name, entry, digest_file(root / name, entry["algorithm"]))
            if mismatch is not None:
                raise CorruptCheckpoint(root, mismatch)
    return manifest


def digest_mismatch(name: str, entry: FileEntry, actual: str) -> str | None:
    """Why file `name` of digest `actual` is not what `entry` says, or None."""
    if actual == entry["digest"]:
        return None
    return (
        f"digest mismatch: {name} {entry['algorithm']} {actual[:12]}..., "
        f"manifest {entry['digest'][:12]}..."
    )
