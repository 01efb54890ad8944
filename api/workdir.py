"""`elastrain submit --working-dir DIR`: the directory as a zip, and its digest.

What is left out, as `.gitignore` lines (gitwildmatch, via `pathspec`): the usual clutter
(`DEFAULT_EXCLUDES`), then the directory's own `.gitignore` and `.elastrainignore` (in that
order, so `.elastrainignore` can re-include with `!`). Links are refused rather than
followed: a link to `/home` would otherwise upload it. The zip is deterministic (sorted,
fixed timestamps), and the digest is computed here the same way the service computes it
(`elastrain.contracts.packages`), so the CLI skips the upload when the service already has it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

from elastrain.contracts.packages import FileEntry, Manifest, PackageLimits, PackageRefused

DEFAULT_EXCLUDES = (
    ".git/",
    ".hg/",
    ".svn/",
    "__pycache__/",
    "*.py[cod]",
    ".venv/",
    "venv/",
    ".elastrain/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    "*.egg-info/",
    ".DS_Store",
)
IGNORE_FILES = (".gitignore", ".elastrainignore")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: no build-time in the bytes


@dataclass(frozen=True)
class PackedDir:
    manifest: Manifest
    archive: Path
    """A temporary zip; the caller deletes it."""


def excludes(root: Path) -> pathspec.PathSpec:
    lines = list(DEFAULT_EXCLUDES)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines += path.read_text(errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def collect(root: Path) -> list[str]:
    """The files to package, as sorted POSIX paths relative to `root`."""
    if not root.is_dir():
        raise PackageRefused(f"{root} is not a directory")
    spec = excludes(root)
    found: list[str] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        rel_folder = Path(folder).relative_to(root)
        kept = []
        for d in sorted(dirs):
            rel = (rel_folder / d).as_posix()
            if spec.match_file(rel + "/"):
                continue
            if (Path(folder) / d).is_symlink():
                raise _link_refused(rel)
            kept.append(d)
        dirs[:] = kept
        for f in files:
            rel = (rel_folder / f).as_posix()
            if spec.match_file(rel):
                continue
            path = Path(folder) / f
            if path.is_symlink():
                raise _link_refused(rel)
            if not path.is_file():
                continue  # sockets, fifos: not code
            found.append(rel)
    return sorted(found)


def _link_refused(rel: str) -> PackageRefused:
    return PackageRefused(
        f"{rel} is a symbolic link; links are not packaged (copy the file in, or list it "
        "in .elastrainignore)"
    )


def pack(root: Path, limits: PackageLimits | None = None) -> PackedDir:
    """Zip the directory's files (see the module doc) into a temporary file."""
    limits = limits or PackageLimits()
    files = collect(root)
    if not files:
        raise PackageRefused(f"{root}: no files to package (all excluded?)")
    if len(files) > limits.max_files:
        raise PackageRefused(f"{root}: {len(files)} files; at most {limits.max_files} allowed")
    sizes = {rel: (root / rel).stat().st_size for rel in files}
    total = sum(sizes.values())
    if total > limits.max_unpacked_bytes:
        largest = sorted(sizes, key=lambda r: -sizes[r])[:3]
        listed = ", ".join(f"{r} ({_mb(sizes[r])})" for r in largest)
        raise PackageRefused(
            f"{root}: {_mb(total)} of files, over the {_mb(limits.max_unpacked_bytes)} limit; "
            f"largest: {listed}. Exclude data with .elastrainignore and put it on the "
            "storage root instead"
        )
    fd, name = tempfile.mkstemp(prefix="elastrain-workdir-", suffix=".zip")
    os.close(fd)
    entries = []
    try:
        with zipfile.ZipFile(name, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for rel in files:
                data = (root / rel).read_bytes()
                info = zipfile.ZipInfo(rel, date_time=_EPOCH)
                info.external_attr = 0o100644 << 16  # a regular file, rw-r--r--
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
                entries.append(
                    FileEntry(path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest())
                )
        if os.path.getsize(name) > limits.max_archive_bytes:
            raise PackageRefused(
                f"{root}: the zip is {_mb(os.path.getsize(name))}, over the "
                f"{_mb(limits.max_archive_bytes)} upload limit"
            )
    except BaseException:
        os.unlink(name)
        raise
    return PackedDir(manifest=Manifest.of(entries), archive=Path(name))


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
