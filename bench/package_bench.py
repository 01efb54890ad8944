"""What shipping a working directory costs: pack (CLI), store (API), make importable (worker).

    .venv/bin/python bench/package_bench.py [--repeats 5] [--data-mb 40] [--out docs/bench-packages.md]

Three folders: the example custom workload (one file), a small project (200 Python files,
~2 MB) and one with a data file (200 files plus 40 MB of incompressible bytes: what a user
who forgets `.elastrainignore` uploads). Each figure is the median of `--repeats` runs on
this machine's local disk. "first on a node" copies and verifies the package into an empty
node cache; "again" is every later attempt on that node (the verified copy is reused).
The report goes between its markers in `--out`; notes written around them stay.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_blocks import write_block
from elastrain.api.workdir import pack
from elastrain.contracts.packages import PackageLimits
from elastrain.service.packages import store_archive
from elastrain.workers import packages as worker_packages

REPO = Path(__file__).resolve().parents[1]


def project(root: Path, files: int, data_mb: int) -> Path:
    for i in range(files):
        sub = root / f"pkg{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 1500)
    if data_mb:
        (root / "data.bin").write_bytes(os.urandom(data_mb * 2**20))
    return root


def measure(folder: Path, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"pack": [], "store": [], "first": [], "again": []}
    size = 0
    for _ in range(repeats):
        work = Path(tempfile.mkdtemp())
        os.environ["ELASTRAIN_PACKAGE_CACHE"] = str(work / "cache")
        t0 = time.perf_counter()
        packed = pack(folder, PackageLimits(max_archive_bytes=2**30, max_unpacked_bytes=2**30))
        t1 = time.perf_counter()
        manifest, _ = store_archive(packed.archive, work / "storage", PackageLimits(2**30, 2**30))
        t2 = time.perf_counter()
        files = worker_packages.materialize(work / "storage", manifest.digest)
        t3 = time.perf_counter()
        worker_packages.materialize(work / "storage", manifest.digest)
        worker_packages.activate(files)
        t4 = time.perf_counter()
        worker_packages.activate(None)
        size = packed.archive.stat().st_size
        packed.archive.unlink()
        shutil.rmtree(work)
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[key].append(value)
    return {**{k: statistics.median(v) for k, v in times.items()}, "zip_kib": size / 2**10}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-mb", type=int, default=40, help="the data file of the third folder")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-packages.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    cases = {
        "examples/custom (1 file)": REPO / "examples" / "custom",
        "200 .py files, ~2 MB": project(scratch / "small", 200, 0),
        f"200 .py files + {args.data_mb} MB data": project(scratch / "big", 200, args.data_mb),
    }
    shown = f" --data-mb {args.data_mb}" if args.data_mb != 40 else ""
    lines = [
        f"`.venv/bin/python bench/package_bench.py --repeats {args.repeats}{shown}`: medians, "
        f"local disk, this machine ({os.cpu_count()} cores). Seconds.",
        "",
        "| folder | zip | pack (CLI) | store (API: check + unpack + hash) | first on a node "
        "(copy + verify) | again (reuse + activate) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, folder in cases.items():
        r = measure(folder, args.repeats)
        lines.append(
            f"| {name} | {r['zip_kib']:,.0f} KiB | {r['pack']:.3f} | {r['store']:.3f} | "
            f"{r['first']:.3f} | {r['again']:.4f} |"
        )
    shutil.rmtree(scratch)
    block = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "packages-report", block, new_document=TITLE)
    print(block)


TITLE = "# Shipping a working directory (`elastrain submit --working-dir`)\n"


if __name__ == "__main__":
    main()
