"""Working-directory packages: paths, digests, storage, and activation in a worker process.

Real zips and real files: the archives a hostile client could send are built byte by byte
here, and every refusal is checked to leave nothing behind, inside or outside the storage
root.
"""

from __future__ import annotations

import io
import os
import stat
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrain.api.workdir import collect, pack
from elastrain.contracts.packages import (
    Manifest,
    PackageLimits,
    PackageRefused,
    hex_of,
    module_in,
    modules_of,
    safe_relative_path,
)
from elastrain.service.packages import load_manifest, packages_root, store_archive
from elastrain.workers import packages as worker_packages


@pytest.mark.parametrize(
    "name",
    [
        "../evil.py",
        "a/../../evil.py",
        "/etc/passwd",
        "C:/x.py",
        "a\\..\\evil.py",
        "a//b.py",
        "./a.py",
        "a/\x1b[31m.py",
        "a/\u202eyp.txt",
        "",
        "x" * 300,
    ],
)
def test_unsafe_member_names_are_refused(name: str) -> None:
    with pytest.raises(PackageRefused):
        safe_relative_path(name)


@pytest.mark.parametrize(
    ("name", "safe"),
    [("a.py", "a.py"), ("pkg/mod.py", "pkg/mod.py"), ("pkg/", "pkg"), ("..a/b..c", "..a/b..c")],
)
def test_safe_member_names(name: str, safe: str) -> None:
    assert safe_relative_path(name) == safe


def test_modules_of_a_tree() -> None:
    paths = ["m.py", "pkg/__init__.py", "pkg/sub.py", "ns/inner.py", "data/x.txt"]
    assert modules_of(paths) == ["m", "ns.inner", "pkg", "pkg.sub"]
    assert module_in("pkg.sub", paths) and module_in("pkg", paths) and module_in("ns.inner", paths)
    assert not module_in("data", paths) and not module_in("pkg.missing", paths)


# -- the client side: what is packaged --------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_collect_honours_ignore_files_and_default_excludes(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "proj",
        {
            "model.py": "x = 1\n",
            "pkg/__init__.py": "",
            "pkg/__pycache__/m.cpython-311.pyc": "",
            ".git/config": "",
            ".venv/bin/python": "",
            "data/big.bin": "0" * 100,
            "data/keep.txt": "kept by a negation",
            "notes.log": "",
            ".gitignore": "*.log\n",
            ".elastrainignore": "data/*\n!data/keep.txt\n",
        },
    )
    assert collect(root) == [
        ".elastrainignore",
        ".gitignore",
        "data/keep.txt",
        "model.py",
        "pkg/__init__.py",
    ]


def test_collect_refuses_links(tmp_path: Path) -> None:
    root = _tree(tmp_path / "proj", {"model.py": ""})
    (root / "secrets").symlink_to("/etc")
    with pytest.raises(PackageRefused, match="symbolic link"):
        collect(root)


def test_pack_refuses_a_directory_over_the_limit_naming_the_largest(tmp_path: Path) -> None:
    root = _tree(tmp_path / "proj", {"model.py": "", "data.bin": "0" * 5000})
    with pytest.raises(PackageRefused, match=r"data\.bin"):
        pack(root, PackageLimits(max_unpacked_bytes=4000))


# -- the service side: storing an upload ---------------------------------------------------------


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "storage"
    root.mkdir()
    yield root
    leftovers = [p.name for p in packages_root(root).glob(".incoming-*")]
    assert not leftovers, f"staging left behind: {leftovers}"


def _zip(members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for info, data in members:
            zf.writestr(info, data)
    return buf.getvalue()


def _store(
    storage: Path, data: bytes, limits: PackageLimits | None = None
) -> tuple[Manifest, bool]:
    archive = storage.parent / "upload.zip"
    archive.write_bytes(data)
    return store_archive(archive, storage, limits or PackageLimits())


def test_the_digest_is_of_the_files_not_the_zip(tmp_path: Path, storage: Path) -> None:
    root = _tree(tmp_path / "proj", {"m.py": "def build(): ...\n", "pkg/util.py": "A = 1\n"})
    packed = pack(root)
    manifest, created = store_archive(packed.archive, storage, PackageLimits())
    assert created and manifest.digest == packed.manifest.digest
    # The same files zipped differently (other order, timestamps, no compression):
    other = io.BytesIO()
    with zipfile.ZipFile(other, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("pkg/", b"")
        zf.writestr("pkg/util.py", b"A = 1\n")
        zf.writestr(zipfile.ZipInfo("m.py", date_time=(2020, 5, 5, 1, 2, 3)), b"def build(): ...\n")
    again, created_again = _store(storage, other.getvalue())
    assert again.digest == manifest.digest and not created_again
    stored = load_manifest(storage, manifest.digest)
    assert stored == manifest
    files = packages_root(storage) / hex_of(manifest.digest) / "files"
    assert (files / "pkg" / "util.py").read_text() == "A = 1\n"
    # One byte more is another package.
    changed, _ = _store(
        storage, _zip([("m.py", b"def build(): ...\n\n"), ("pkg/util.py", b"A = 1\n")])
    )
    assert changed.digest != manifest.digest


def _link(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


def _fifo(name: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    return info, b""


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([("../escape.py", b"x")], "'..'"),
        ([("ok.py", b""), ("pkg/../../escape.py", b"x")], "'..'"),
        ([("/tmp/abs.py", b"x")], "absolute"),
        ([_link("link.py", "/etc/passwd")], "symbolic links"),
        ([_fifo("pipe")], "regular files"),
        ([("a.py", b"1"), ("a.py", b"2")], "twice"),
        ([("a", b"file"), ("a/b.py", b"x")], "is a file"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink", "fifo", "duplicate", "file-as-folder"],
)
def test_unsafe_archives_are_refused_and_nothing_is_written(
    tmp_path: Path, storage: Path, members: list, message: str
) -> None:
    before = set(tmp_path.rglob("*"))
    with pytest.raises(PackageRefused, match=message):
        _store(storage, _zip(members))
    after = set(tmp_path.rglob("*")) - before - {storage.parent / "upload.zip"}
    assert after <= {packages_root(storage)}, after
    assert not (tmp_path / "escape.py").exists() and not Path("/tmp/abs.py").exists()


def test_not_a_zip_and_oversized_archives_are_refused(storage: Path) -> None:
    with pytest.raises(PackageRefused, match="not a zip"):
        _store(storage, b"PK\x03\x04 but not really a zip")
    bomb = _zip([("zeros.bin", b"\0" * 2_000_000)])  # ~2 KB that unpacks to 2 MB
    with pytest.raises(PackageRefused, match="unpacks to"):
        _store(storage, bomb, PackageLimits(max_unpacked_bytes=1_000_000))
    with pytest.raises(PackageRefused, match="at most 2 files"):
        _store(storage, _zip([(f"f{i}.py", b"") for i in range(3)]), PackageLimits(max_files=2))
    assert list(packages_root(storage).iterdir()) == []


def test_a_member_that_lies_about_its_size_is_refused(storage: Path) -> None:
    data = bytearray(_zip([("zeros.bin", b"\0" * 200_000)]))
    # Rewrite the declared size (local header and central directory) to 10 bytes.
    real = (200_000).to_bytes(4, "little")
    fake = (10).to_bytes(4, "little")
    data = bytearray(bytes(data).replace(real, fake))
    with pytest.raises(PackageRefused):
        _store(storage, bytes(data), PackageLimits(max_unpacked_bytes=100_000))
    assert list(packages_root(storage).iterdir()) == []


# -- the worker side: importable, verified, and forgotten by the next job -------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cache"
    monkeypatch.setenv("ELASTRAIN_PACKAGE_CACHE", str(root))
    path_before, modules_before = list(sys.path), set(sys.modules)
    yield root
    worker_packages.activate(None)
    sys.path[:] = path_before
    for name in set(sys.modules) - modules_before:
        del sys.modules[name]


def _upload(tmp_path: Path, storage: Path, name: str, files: dict[str, str]) -> str:
    packed = pack(_tree(tmp_path / name, files))
    manifest, _ = store_archive(packed.archive, storage, PackageLimits())
    return manifest.digest


def test_each_job_imports_its_own_package(tmp_path: Path, storage: Path, cache: Path) -> None:
    import importlib

    first = _upload(
        tmp_path,
        storage,
        "a",
        {"wd_model.py": "from wd_helper import V\n", "wd_helper.py": "V = 'a'\n"},
    )
    second = _upload(
        tmp_path,
        storage,
        "b",
        {"wd_model.py": "from wd_helper import V\n", "wd_helper.py": "V = 'b'\n"},
    )

    files = worker_packages.materialize(storage, first)
    worker_packages.activate(files)
    worker_packages.import_from(files, "wd_model")
    assert importlib.import_module("wd_model").V == "a"

    files = worker_packages.materialize(storage, second)
    worker_packages.activate(files)  # same module names, other content: nothing of `a` stays
    worker_packages.import_from(files, "wd_model")
    assert importlib.import_module("wd_model").V == "b"
    assert not any(str(cache / hex_of(first)) in p for p in sys.path)

    worker_packages.activate(None)
    with pytest.raises(ImportError):
        importlib.import_module("wd_model")


def test_a_tampered_package_is_refused(tmp_path: Path, storage: Path, cache: Path) -> None:
    digest = _upload(tmp_path, storage, "a", {"wd_model.py": "X = 1\n"})
    target = packages_root(storage) / hex_of(digest) / "files" / "wd_model.py"
    os.chmod(target, 0o644)
    target.write_text("X = 2  # changed on shared storage\n")
    with pytest.raises(worker_packages.PackageUnavailable, match="differs"):
        worker_packages.materialize(storage, digest)
    assert not (cache / hex_of(digest)).exists()


def test_a_module_that_resolves_outside_the_package_is_refused(
    tmp_path: Path, storage: Path, cache: Path
) -> None:
    digest = _upload(tmp_path, storage, "a", {"wd_model.py": "X = 1\n"})
    files = worker_packages.materialize(storage, digest)
    worker_packages.activate(files)
    with pytest.raises(worker_packages.PackageUnavailable, match="not from the job's package"):
        worker_packages.import_from(files, "json")


# -- retention -------------------------------------------------------------------------------

DAY = 86400.0


@pytest.mark.parametrize(
    ("stored", "in_use", "expected"),
    [
        pytest.param({}, set(), [], id="nothing-stored"),
        pytest.param({"sha256:a": 0.0}, set(), ["sha256:a"], id="old-and-unused"),
        pytest.param({"sha256:a": 0.0}, {"sha256:a"}, [], id="an-unfinished-job-uses-it"),
        pytest.param({"sha256:a": 9 * DAY}, set(), [], id="submitted-with-recently"),
        pytest.param(
            {"sha256:a": 0.0, "sha256:b": 3.1 * DAY, "sha256:c": 1.0},
            {"sha256:c"},
            ["sha256:a"],
            id="only-the-stale-unused-ones",
        ),
    ],
)
def test_stale_packages(stored: dict[str, float], in_use: set[str], expected: list[str]) -> None:
    from elastrain.service.packages import stale_packages

    assert stale_packages(stored, in_use, now=10 * DAY, keep_s=7 * DAY) == expected


def test_sweep_deletes_whole_packages_and_abandoned_uploads(tmp_path: Path, storage: Path) -> None:
    import time

    from elastrain.service.packages import sweep, touch

    old = _upload(tmp_path, storage, "old", {"m.py": "A = 1\n"})
    used = _upload(tmp_path, storage, "used", {"m.py": "A = 2\n"})
    fresh = _upload(tmp_path, storage, "fresh", {"m.py": "A = 3\n"})
    now = time.time()
    for digest in (old, used, fresh):
        manifest = packages_root(storage) / hex_of(digest) / "manifest.json"
        os.utime(manifest, (now - 30 * DAY, now - 30 * DAY))
    touch(storage, fresh)  # a job was just submitted with it
    abandoned = packages_root(storage) / ".incoming-dead.zip"
    abandoned.write_bytes(b"half an upload")
    os.utime(abandoned, (now - 2 * 3600, now - 2 * 3600))
    half_deleted = packages_root(storage) / ".deleting-0123"
    half_deleted.mkdir()

    assert sweep(storage, {used}, now=now, keep_s=7 * DAY) == [old]
    assert load_manifest(storage, old) is None
    assert not (packages_root(storage) / hex_of(old)).exists()
    assert load_manifest(storage, used) is not None and load_manifest(storage, fresh) is not None
    assert not abandoned.exists() and not half_deleted.exists()
