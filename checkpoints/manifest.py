"""The checkpoint manifest, written last and atomically: a step folder without one is not
a checkpoint. It holds what a resume needs beyond the tensors, and every file's size and
digest by the algorithm its entry names. Pure Python.

Digests are for corruption (bit rot, a torn or overwritten shard), not tampering: whoever
can write a shard can rewrite the manifest beside it. So the default is XXH3-128, at
memory speed (~29 GB/s a core against sha256's 1.9 GB/s, docs/bench-checkpoint.md), which
lets a verified load keep up with a plain read; sha256 on request (`checkpoint.digest`).
An algorithm name a reader does not know is refused by name, not read as a mismatch.

Format 1 gave every file `{size, sha256}`, 2 gives `{size, digest, algorithm}`; both are
read (a version-1 entry as `algorithm: sha256`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict

import xxhash

from elastrain.checkpoints.confined import atomic_write_bytes
from elastrain.checkpoints.layout import MANIFEST_NAME
from elastrain.contracts.files import ConfinedFileError, read_bounded

XXH3_128 = "xxh3-128"
SHA256 = "sha256"
DEFAULT_ALGORITHM = XXH3_128


class Hasher(Protocol):
    """What hashlib's and xxhash's objects both offer."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_CONSTRUCTORS: dict[str, Callable[[], Hasher]] = {XXH3_128: xxhash.xxh3_128, SHA256: hashlib.sha256}
ALGORITHMS = tuple(_CONSTRUCTORS)
# The job spec's `checkpoint.digest` values -> the names manifests carry.
_SETTINGS = {"xxh3": XXH3_128, "sha256": SHA256}


class UnknownDigestAlgorithm(ValueError):
    def __init__(self, algorithm: object) -> None:
        super().__init__(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        self.algorithm = algorithm


def new_hasher(algorithm: str) -> Hasher:
    return _CONSTRUCTORS[check_algorithm(algorithm)]()


def check_algorithm(algorithm: object) -> str:
    """`algorithm` if it is one of ALGORITHMS, else UnknownDigestAlgorithm."""
    if not isinstance(algorithm, str) or algorithm not in _CONSTRUCTORS:
        raise UnknownDigestAlgorithm(algorithm)
    return algorithm


def algorithm_for_setting(setting: str) -> str:
    """The manifest's name for a `checkpoint.digest` setting (or a manifest name)."""
    return _SETTINGS[setting] if setting in _SETTINGS else check_algorithm(setting)


FORMAT_VERSION = 2
#: A manifest names each shard file with its size and digest (~120 bytes a file): 16 MiB
#: is 100,000+ files. A job's code can write its manifest; past this it is not read.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class FileEntry(TypedDict):
    size: int
    digest: str
    """Hex digest of the file's bytes, by `algorithm`."""
    algorithm: str
    """One of `ALGORITHMS`."""


def parse_file_entry(name: str, entry: object) -> FileEntry:
    """A manifest's entry for file `name`, in either format; ValueError otherwise."""
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
    """Relative file name -> entry, for every file of the checkpoint."""
    total_bytes: int = 0
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Strict about the fields a loader relies on, lenient about unknown (newer) ones."""
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


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Commit a checkpoint, once every other file is durable; atomic."""
    path = Path(ckpt_dir) / MANIFEST_NAME
    atomic_write_bytes(path, json.dumps(manifest.to_dict(), indent=1, sort_keys=True).encode())
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    try:
        raw = read_bounded(str(Path(ckpt_dir) / MANIFEST_NAME), MAX_MANIFEST_BYTES)
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
