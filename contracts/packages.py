"""A job's own code: a working directory, packaged, stored by its content, importable on workers.

`elastrain submit --working-dir DIR` zips DIR (`elastrain.api.workdir`), uploads it once
(`POST /v1/packages`, `elastrain.service.packages`) and puts its digest in `workload.package`. Every
worker of every attempt copies that exact tree from the storage root to a node-local cache,
checks it against the digest, and imports the entrypoint from it (`elastrain.workers.packages`).

The digest is of the files, not of the zip: the same directory gives the same digest however
it was zipped (timestamps, compression, order). For each file, sorted by path, one line
`<posix path> NUL <size> NUL <sha256 of the content> LF` is hashed with SHA-256. Only regular
files count: no empty folders, no permission bits, no links (an archive holding a link is
refused).

Torch-free and effect-free: the API, the CLI and the workers share these definitions.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath

from elastrain.contracts.bounds import OWN_PACKAGES as _OWN_PACKAGES

DIGEST_PREFIX = "sha256:"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
#: Under the storage root: `packages/<hex digest>/files/...` and `.../manifest.json`.
PACKAGES_DIR = "packages"
MANIFEST = "manifest.json"
FILES_DIR = "files"
MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 255


class PackageRefused(ValueError):
    """The archive or directory cannot become a package; the message says why."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """POSIX path relative to the package root."""
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    digest: str
    files: tuple[FileEntry, ...]

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps(
            {"digest": self.digest, "files": [asdict(f) for f in self.files]}, indent=1
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(digest=data["digest"], files=tuple(FileEntry(**f) for f in data["files"]))

    @classmethod
    def of(cls, files: Iterable[FileEntry]) -> Manifest:
        ordered = tuple(sorted(files, key=lambda f: f.path))
        return cls(digest=tree_digest(ordered), files=ordered)

    def has_module(self, module: str) -> bool:
        return module_in(module, (f.path for f in self.files))


def tree_digest(files: Iterable[FileEntry]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return DIGEST_PREFIX + h.hexdigest()


def hex_of(digest: str) -> str:
    """`sha256:<hex>` -> `<hex>` (the folder name), refusing anything else."""
    if not DIGEST_RE.match(digest):
        raise PackageRefused(f"{digest[:80]!r} is not a package digest ('sha256:' + 64 hex)")
    return digest.removeprefix(DIGEST_PREFIX)


def safe_relative_path(name: str) -> str:
    """A member name as a safe relative POSIX path, or PackageRefused saying why.

    Refused: absolute paths, drive letters, backslashes, `..`/`.` components (zip-slip),
    empty components, control characters, over-long names."""
    if not name or len(name) > MAX_PATH_CHARS:
        raise PackageRefused(f"path {name[:80]!r}: empty or longer than {MAX_PATH_CHARS}")
    if any(unicodedata.category(ch) in ("Cc", "Cf") for ch in name):
        raise PackageRefused(f"path {name[:80]!r}: holds control characters")
    if "\\" in name:
        raise PackageRefused(f"path {name[:80]!r}: backslashes are not allowed")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise PackageRefused(f"path {name[:80]!r}: absolute paths are not allowed")
    parts = name.split("/")
    if parts[-1] == "":  # a folder entry "a/b/"
        parts = parts[:-1]
    for part in parts:
        if part in ("", ".", ".."):
            raise PackageRefused(f"path {name[:80]!r}: '..', '.' and empty parts are not allowed")
        if len(part) > MAX_NAME_CHARS:
            raise PackageRefused(f"path {name[:80]!r}: a name is longer than {MAX_NAME_CHARS}")
    return str(PurePosixPath(*parts))


#: This service's own top-level packages: a job's module with one of these names would be
#: shadowed by (or shadow) the service's code in the worker processes.
OWN_PACKAGES = _OWN_PACKAGES


def modules_of(paths: Iterable[str]) -> list[str]:
    """The importable modules of a tree (`a/b.py` -> `a.b`, `a/__init__.py` -> `a`)."""
    found = []
    for p in paths:
        if p.endswith("/__init__.py"):
            found.append(p.removesuffix("/__init__.py").replace("/", "."))
        elif p.endswith(".py"):
            found.append(p.removesuffix(".py").replace("/", "."))
    return sorted(found)


def module_in(module: str, paths: Iterable[str]) -> bool:
    """Is `pkg.mod` a module of this tree (`pkg/mod.py` or `pkg/mod/__init__.py`)?"""
    base = module.replace(".", "/")
    wanted = {f"{base}.py", f"{base}/__init__.py"}
    return any(p in wanted for p in paths)


@dataclass(frozen=True, slots=True)
class PackageLimits:
    max_archive_bytes: int = 64 * 2**20
    """The upload (the zip) itself."""
    max_unpacked_bytes: int = 256 * 2**20
    """All files once unpacked: what bounds a zip bomb."""
    max_files: int = 10_000
    max_expansion: float = 100.0
    """Unpacked bytes per byte of the zip, beyond `EXPANSION_FLOOR`: a few KiB that
    inflate to hundreds of MiB are a bomb, whatever the absolute limit allows."""

    def unpacked_budget(self, archive_bytes: int) -> tuple[int, str]:
        """The most bytes a zip of `archive_bytes` may unpack to, and which limit that is."""
        by_ratio = max(int(self.max_expansion * archive_bytes), EXPANSION_FLOOR)
        if by_ratio < self.max_unpacked_bytes:
            return by_ratio, (
                f"{self.max_expansion:g} times the {archive_bytes}-byte upload "
                "(ELASTRAIN_MAX_PACKAGE_EXPANSION)"
            )
        return self.max_unpacked_bytes, "ELASTRAIN_MAX_PACKAGE_UNPACKED_BYTES"


#: Archives this small may expand past the ratio up to this many bytes (a tiny zip of text
#: legitimately compresses more than code usually does).
EXPANSION_FLOOR = 1 << 20


class PackageQuotaExceeded(PackageRefused):
    """Storing the package would take the tenant past its storage quota."""
