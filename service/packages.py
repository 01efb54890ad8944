"""Uploaded working directories, stored under the storage root by their content's digest.

```
<storage>/packages/<hex digest>/manifest.json   every file's path, size and sha256
<storage>/packages/<hex digest>/files/...       the tree, as uploaded
<storage>/packages/.incoming-<random>/          an upload being checked (removed after)
```

An archive is checked member by member before anything is written (no absolute paths, no
`..`, no links or devices, no duplicates, no encryption), then unpacked into a private
staging folder while its real (not declared) sizes are counted against the limits, and
renamed into place only when complete: a package folder either holds the whole tree or does
not exist. Storing the same content twice finds the first copy and keeps it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from elastrain.checkpoints.confined import atomic_write_bytes, fsync_dir, remove_tree
from elastrain.contracts.packages import (
    DIGEST_PREFIX,
    FILES_DIR,
    MANIFEST,
    PACKAGES_DIR,
    FileEntry,
    Manifest,
    PackageLimits,
    PackageQuotaExceeded,
    PackageRefused,
    hex_of,
    safe_relative_path,
)

_CHUNK = 1 << 20
#: An upload still staged after this long was abandoned (its server died mid-way).
ABANDONED_UPLOAD_S = 3600.0


def packages_root(storage: Path) -> Path:
    return storage / PACKAGES_DIR


def package_dir(storage: Path, digest: str) -> Path:
    return packages_root(storage) / hex_of(digest)


def load_manifest(storage: Path, digest: str) -> Manifest | None:
    """The stored package's manifest, or None when no complete package has that digest."""
    try:
        return Manifest.from_json((package_dir(storage, digest) / MANIFEST).read_text())
    except FileNotFoundError:
        return None


def incoming_path(storage: Path, suffix: str = "") -> Path:
    """A fresh private path for an upload in progress (under the storage root)."""
    root = packages_root(storage)
    root.mkdir(parents=True, exist_ok=True)
    return root / f".incoming-{uuid.uuid4().hex}{suffix}"


def touch(storage: Path, digest: str) -> None:
    """Mark the package used now (a job was submitted with it): retention counts from here."""
    with contextlib.suppress(OSError):
        os.utime(package_dir(storage, digest) / MANIFEST)


def stored_packages(storage: Path) -> dict[str, float]:
    """Every complete package: digest -> when it was last used (its manifest's mtime)."""
    found: dict[str, float] = {}
    root = packages_root(storage)
    for manifest in root.glob(f"*/{MANIFEST}") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            found[DIGEST_PREFIX + manifest.parent.name] = manifest.stat().st_mtime
    return found


def stale_packages(
    stored: dict[str, float], in_use: set[str], *, now: float, keep_s: float
) -> list[str]:
    """The packages to delete: no unfinished job names them and none was submitted with them
    for `keep_s` (so re-running a finished job's code soon after does not upload it again)."""
    return sorted(d for d, used in stored.items() if d not in in_use and now - used > keep_s)


def sweep(storage: Path, in_use: set[str], *, now: float, keep_s: float) -> list[str]:
    """Delete stale packages and abandoned uploads; returns the digests deleted."""
    deleted = []
    for digest in stale_packages(stored_packages(storage), in_use, now=now, keep_s=keep_s):
        folder = package_dir(storage, digest)
        try:
            if now - (folder / MANIFEST).stat().st_mtime <= keep_s:
                continue  # submitted with again since it was listed
            # Renamed away first: a reader sees the whole package or none of it.
            doomed = folder.with_name(f".deleting-{uuid.uuid4().hex}")
            os.rename(folder, doomed)
        except OSError:
            continue
        remove_tree(doomed)
        deleted.append(digest)
    root = packages_root(storage)
    for leftover in sorted(root.glob(".[id][ne]*-*")) if root.is_dir() else ():
        # `.deleting-*`: a sweep that died half-way; `.incoming-*`: an abandoned upload.
        with contextlib.suppress(OSError):
            if leftover.name.startswith(".deleting-") or (
                now - leftover.stat().st_mtime > ABANDONED_UPLOAD_S
            ):
                remove_tree(leftover)
    return deleted


@dataclass(frozen=True, slots=True)
class Budget:
    """The most bytes an upload may unpack to, and the limit that sets it (for the 4xx)."""

    max_bytes: int
    limit: str
    quota: bool = False
    """The tenant's storage quota is what binds (a 413, not a 422)."""

    def refuse(self, unpacked: str) -> PackageRefused:
        why = f"unpacks to {unpacked} bytes; at most {self.max_bytes} allowed ({self.limit})"
        return PackageQuotaExceeded(why) if self.quota else PackageRefused(why)


def budget_for(archive_bytes: int, limits: PackageLimits, quota_left: int | None) -> Budget:
    """What a zip of `archive_bytes` may unpack to: the absolute limit, the expansion ratio,
    and what the tenant's storage quota has left, whichever is least."""
    most, limit = limits.unpacked_budget(archive_bytes)
    if quota_left is not None and quota_left < most:
        return Budget(
            max(quota_left, 0),
            "the tenant's storage quota, ELASTRAIN_PACKAGE_QUOTA_BYTES",
            quota=True,
        )
    return Budget(most, limit)


def store_archive(
    archive: Path, storage: Path, limits: PackageLimits, *, quota_left: int | None = None
) -> tuple[Manifest, bool]:
    """Check and unpack a zip into the package store: (its manifest, whether it is new).

    The bytes are counted as they are inflated, against the least of the unpacked limit,
    `limits.max_expansion` times the zip's size and `quota_left` (what the uploading
    tenant's storage quota has left): the first chunk past it stops the upload, before it
    is written."""
    budget = budget_for(archive.stat().st_size, limits, quota_left)
    staging = incoming_path(storage)
    try:
        with _open_zip(archive) as zf:
            members = _checked_members(zf, limits, budget)
            entries = _unpack(zf, members, staging / FILES_DIR, budget)
        manifest = Manifest.of(entries)
        atomic_write_bytes(staging / MANIFEST, manifest.to_json().encode())
        final = package_dir(storage, manifest.digest)
        if load_manifest(storage, manifest.digest) is not None:
            return manifest, False
        try:
            os.rename(staging, final)
        except OSError:
            # Another upload of the same content won the race (or a torn folder without a
            # manifest is in the way: replace it).
            if load_manifest(storage, manifest.digest) is not None:
                return manifest, False
            remove_tree(final)
            os.rename(staging, final)
        fsync_dir(final.parent)
        return manifest, True
    finally:
        if staging.exists():
            remove_tree(staging)


def _open_zip(archive: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise PackageRefused(f"the upload is not a zip archive ({exc})") from exc


def _checked_members(
    zf: zipfile.ZipFile, limits: PackageLimits, budget: Budget
) -> list[tuple[zipfile.ZipInfo, str]]:
    """The archive's files with safe paths; refuses the whole archive on the first bad one."""
    infos = zf.infolist()
    if len(infos) > limits.max_files:
        raise PackageRefused(f"{len(infos)} entries; at most {limits.max_files} files allowed")
    files: list[tuple[zipfile.ZipInfo, str]] = []
    seen: set[str] = set()
    folders: set[str] = set()
    declared = 0
    for info in infos:
        path = safe_relative_path(info.filename)
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if stat.S_ISLNK(mode):
            raise PackageRefused(f"path {path!r}: symbolic links are not allowed")
        if info.is_dir():
            folders.add(path)
            continue
        if kind not in (0, stat.S_IFREG):
            raise PackageRefused(f"path {path!r}: only regular files and folders are allowed")
        if info.flag_bits & 0x1:
            raise PackageRefused(f"path {path!r}: encrypted entries are not allowed")
        if path in seen:
            raise PackageRefused(f"path {path!r}: appears twice")
        seen.add(path)
        declared += info.file_size
        files.append((info, path))
    if declared > budget.max_bytes:  # what the archive admits to; its real sizes below
        raise budget.refuse(str(declared))
    for path in seen:  # "a" as a file and "a/b" inside it cannot both exist
        parents = {str(p) for p in Path(path).parents if str(p) != "."}
        clash = parents & seen
        if clash:
            raise PackageRefused(f"path {path!r}: {sorted(clash)[0]!r} is a file, not a folder")
    return files


def _unpack(
    zf: zipfile.ZipFile,
    members: list[tuple[zipfile.ZipInfo, str]],
    into: Path,
    budget: Budget,
) -> list[FileEntry]:
    """Write each member under `into`, counting the bytes as they come (a member may lie
    about its size), never following a link and never overwriting."""
    into.mkdir(parents=True)
    total = 0
    entries: list[FileEntry] = []
    for info, path in members:
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out, _reading(zf, info, path) as src:
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                total += len(chunk)
                if total > budget.max_bytes:  # before this chunk is written
                    raise budget.refuse(f"more than {budget.max_bytes}")
                digest.update(chunk)
                out.write(chunk)
        entries.append(FileEntry(path=path, size=size, sha256=digest.hexdigest()))
    return entries


@contextlib.contextmanager
def _reading(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> Iterator[IO[bytes]]:
    """Open a member; a corrupt one (bad CRC, truncated, unknown compression) is refused."""
    try:
        with zf.open(info) as src:
            yield src
    except (zipfile.BadZipFile, NotImplementedError, EOFError, zlib.error) as exc:
        raise PackageRefused(f"path {path!r}: corrupt in the archive ({exc})") from exc
