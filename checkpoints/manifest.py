"""The checkpoint manifest: what a committed checkpoint is. Pure Python.

`manifest.json` is written last and atomically; a step folder without one is not a checkpoint
(it is a save in progress, or a crashed one). Everything a resume needs beyond the tensors
lives here: step, attempt, world size, strategy and layout, data position, free-form extras
(seed, global batch...), and the size and digest of every file so corruption is detectable.

Format versions: 1 gave every file `{size, sha256}`; 2 gives `{size, digest, algorithm}`
(`elastrain.checkpoints.digest`: XXH3-128 by default, sha256 on request). Both are read; a version-1
entry is read as `algorithm: sha256`, so checkpoints written before version 2 still verify.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from elastrain.checkpoints._fs import atomic_write_bytes
from elastrain.checkpoints.confined import ConfinedFileError, read_bounded
from elastrain.checkpoints.digest import SHA256, UnknownDigestAlgorithm, check_algorithm
from elastrain.checkpoints.layout import MANIFEST_NAME

# 2: per-file digest with its algorithm named (an older reader refuses it by version,
# clearly, rather than as a file entry it cannot parse).
FORMAT_VERSION = 2
#: A manifest names each shard file with its size and digest (~120 bytes a file): 16 MiB
#: is 100,000+ files. A job's code can write its manifest; past this it is not read.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class FileEntry(TypedDict):
    size: int
    digest: str
    """Hex digest of the file's bytes, by `algorithm`."""
    algorithm: str
    """One of `elastrain.checkpoints.digest.ALGORITHMS`."""


def parse_file_entry(name: str, entry: object) -> FileEntry:
    """A manifest's entry for file `name`, either format: {size, digest, algorithm} or
    (version 1) {size, sha256}. ValueError naming the file otherwise."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        raise ValueError(f"bad file entry for {name!r}")
    if "digest" in entry or "algorithm" in entry:
        digest = entry.get("digest")
        try:
            algorithm = check_algorithm(entry.get("algorithm"))
        except UnknownDigestAlgorithm as e:
            raise ValueError(f"file entry for {name!r}: {e}") from None
    else:
        digest, algorithm = entry.get("sha256"), SHA256
    if not isinstance(digest, str):
        raise ValueError(f"bad file entry for {name!r}")
    return FileEntry(size=entry["size"], digest=digest, algorithm=algorithm)


class ManifestError(Exception):
    """The manifest of `path` is missing or unreadable."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class ManifestMissing(ManifestError):
    """No manifest.json: the checkpoint was never committed (or is being deleted)."""


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    attempt: int
    world_size: int
    strategy: str = ""
    layout: dict[str, Any] = field(default_factory=dict)
    """e.g. {"dp": 2, "pp": 1}"""
    data_position: dict[str, Any] = field(default_factory=dict)
    """e.g. {"step": S, "samples_consumed": N}"""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-serialisable: seed, global batch size..."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    """Relative file name -> size, digest and its algorithm, for every file of the
    checkpoint."""
    total_bytes: int = 0
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Strict about the fields a loader relies on, lenient about unknown ones (a newer
        writer may add fields; an older reader should still find the checkpoint)."""
        if not isinstance(data, dict):
            raise ValueError("manifest is not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {version!r}")
        for key in ("step", "attempt", "world_size", "total_bytes"):
            if not isinstance(data.get(key), int) or data[key] < 0:
                raise ValueError(f"field {key!r} must be a non-negative int")
        files = data.get("files")
        if not isinstance(files, dict):
            raise ValueError("field 'files' must be an object")
        entries: dict[str, FileEntry] = {}
        for name, entry in files.items():
            entries[name] = parse_file_entry(name, entry)
            if os.path.isabs(name) or ".." in Path(name).parts:
                raise ValueError(f"file name {name!r} escapes the checkpoint folder")
        return cls(
            format_version=version,
            step=data["step"],
            attempt=data["attempt"],
            world_size=data["world_size"],
            strategy=str(data.get("strategy", "")),
            layout=dict(data.get("layout") or {}),
            data_position=dict(data.get("data_position") or {}),
            extra=dict(data.get("extra") or {}),
            files=entries,
            total_bytes=data["total_bytes"],
            created_at=float(data.get("created_at", 0.0)),
        )


def manifest_path(ckpt_dir: str | os.PathLike[str]) -> Path:
    return Path(ckpt_dir) / MANIFEST_NAME


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Commit a checkpoint: call only once every other file is durably written. Atomic, so
    a crash leaves either no manifest (not committed) or a complete one."""
    data = json.dumps(manifest.to_dict(), indent=1, sort_keys=True).encode()
    path = manifest_path(ckpt_dir)
    atomic_write_bytes(path, data)
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    path = manifest_path(ckpt_dir)
    try:
        raw = read_bounded(str(path), MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestMissing(ckpt_dir, f"no {MANIFEST_NAME} (not committed)") from None
    except ConfinedFileError as e:
        raise ManifestError(ckpt_dir, str(e)) from None
    except OSError as e:
        raise ManifestError(ckpt_dir, f"cannot read {MANIFEST_NAME}: {e}") from e
    try:
        return Manifest.from_dict(json.loads(raw))
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise ManifestError(ckpt_dir, f"unparseable {MANIFEST_NAME}: {e}") from e
