"""A job's uploaded package in a worker process: copied to the node, verified, importable.

The package lives once on the storage root (`elastrain.service.packages`). Each node copies it into a
node-local cache (`$ELASTRAIN_PACKAGE_CACHE`, default `<tmp>/elastrain-packages/<hex>`),
hashing every file on the way and checking the whole tree against the digest the job names,
so every rank of every attempt imports exactly the code that was submitted, or fails saying
it could not. Later attempts on the node reuse the verified copy.

Worker processes outlive jobs, so activation is also a clean-up: the modules and the
`sys.path` entry of the previous job's package are dropped, and so are any modules already
imported under the names this package defines, before the new package goes first on
`sys.path`. The current directory is not changed (the process is shared by attempts of
other jobs); code finds its own files with `Path(__file__).parent`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from elastrain.contracts.packages import (
    FILES_DIR,
    MANIFEST,
    PACKAGES_DIR,
    FileEntry,
    Manifest,
    hex_of,
    modules_of,
    tree_digest,
)

_VERIFIED = ".verified"
_CHUNK = 1 << 20


class PackageUnavailable(RuntimeError):
    """The job's package cannot be read from the storage root, or does not match its digest."""


def cache_root() -> Path:
    configured = os.environ.get("ELASTRAIN_PACKAGE_CACHE")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "elastrain-packages"


def materialize(storage_root: Path, digest: str) -> Path:
    """The package's files on this node, verified against `digest` (copied on first use)."""
    hex_digest = hex_of(digest)
    local = cache_root() / hex_digest
    if (local / _VERIFIED).exists():
        return local / FILES_DIR
    source = storage_root / PACKAGES_DIR / hex_digest
    try:
        manifest = Manifest.from_json((source / MANIFEST).read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackageUnavailable(
            f"package {digest}: cannot read its manifest under {source} ({exc}); is the "
            "storage root shared by every node?"
        ) from exc
    staging = cache_root() / f".incoming-{hex_digest[:16]}-{uuid.uuid4().hex[:8]}"
    try:
        copied = [_copy_checked(source / FILES_DIR, staging / FILES_DIR, f) for f in manifest.files]
        if tree_digest(copied) != digest or manifest.digest != digest:
            raise PackageUnavailable(f"package {digest}: its files do not match the digest")
        (staging / _VERIFIED).touch()
        try:
            os.rename(staging, local)
        except OSError:
            if not (local / _VERIFIED).exists():  # not another rank's finished copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local / FILES_DIR


def _copy_checked(src_root: Path, dst_root: Path, entry: FileEntry) -> FileEntry:
    src, dst = src_root / entry.path, dst_root / entry.path
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fin, open(dst, "xb") as fout:
            while chunk := fin.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
                fout.write(chunk)
    except OSError as exc:
        raise PackageUnavailable(f"package file {entry.path}: cannot be read ({exc})") from exc
    if h.hexdigest() != entry.sha256 or size != entry.size:
        raise PackageUnavailable(f"package file {entry.path}: content differs from its manifest")
    return FileEntry(path=entry.path, size=size, sha256=h.hexdigest())


#: The package this process imports from (None: none since it started, or cleared).
_active: Path | None = None


def activate(files: Path | None) -> None:
    """Make `files` (a materialized package, or None for none) what this process imports
    user code from, dropping what the previous package left behind."""
    global _active
    if files is None and _active is None:
        return  # every attempt start of a job without a package: nothing to undo
    roots = (str(cache_root()), str(cache_root().resolve()))  # string tests: no I/O per module
    names = set()
    if files is not None:
        names = {m.split(".")[0] for m in modules_of(_py_files(files))}
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in names or origin.startswith(roots):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not p.startswith(roots)]
    if files is not None:
        sys.path.insert(0, str(files))
    _active = files
    importlib.invalidate_caches()


def import_from(files: Path, module_name: str) -> None:
    """Import the entrypoint's module now, and refuse it unless it came from the package."""
    module = importlib.import_module(module_name)
    origin = getattr(module, "__file__", None)
    if not origin or not _under(Path(origin), files.resolve()):
        raise PackageUnavailable(
            f"workload.entrypoint: module {module_name!r} was imported from {origin}, "
            "not from the job's package"
        )


def _py_files(files: Path) -> list[str]:
    return [p.relative_to(files).as_posix() for p in files.rglob("*.py")]


def _under(path: Path, root: Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return path.resolve().is_relative_to(root)
    return False
