"""Import hygiene: the API and the service never load torch, nor the API Ray;
the shared contracts load none of the heavy packages.

Each check runs in a fresh interpreter (this one has loaded who knows what). Modules are
imported one at a time and `sys.modules` is checked after each, so a failure names the
first module that pulled the forbidden package in.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import importlib, json, sys
forbidden = set(sys.argv[1].split(","))
report = {}
for step in sys.argv[2:]:
    if step == "create_app":
        importlib.import_module("api.main").create_app()
    else:
        importlib.import_module(step)
    report[step] = sorted({m.split(".")[0] for m in sys.modules} & forbidden)
print(json.dumps(report))
"""


def _first_offender(steps: list[str], forbidden: set[str]) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(sorted(forbidden)), *steps],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    report: dict[str, list[str]] = json.loads(out.strip().splitlines()[-1])
    return {step: loaded for step, loaded in report.items() if loaded}


def test_api_loads_neither_torch_nor_ray() -> None:
    steps = ["api.main", "api.cli", "api.routes.jobs", "create_app"]
    assert _first_offender(steps, {"torch", "ray", "workers"}) == {}


def _service_modules() -> list[str]:
    import service

    names = [m.name for m in pkgutil.walk_packages(service.__path__, "service.")]
    # The launcher is the one place that talks to Ray (see the import table below).
    return sorted(n for n in names if not n.startswith(("service.launcher", "service.migrations")))


def test_contracts_load_nothing_heavy() -> None:
    steps = ["contracts.spec", "contracts.messages", "contracts.storage"]
    assert _first_offender(steps, {"torch", "ray", "sqlalchemy", "numpy"}) == {}


def test_service_does_not_load_torch() -> None:
    modules = _service_modules()
    assert "service.jobs" in modules
    assert _first_offender(modules, {"torch", "workers", "api"}) == {}


# The import table, checked statically over every source file: who may
# import what, including imports inside functions.
_FORBIDDEN: dict[str, set[str]] = {
    # Shared by every other package across process boundaries: stdlib and pydantic only.
    "contracts": {"torch", "ray", "sqlalchemy", "service", "api", "workers", "checkpoints"},
    "api": {"torch", "ray", "workers"},
    "service": {"torch", "workers", "api"},
    "workers": {"sqlalchemy", "service", "api"},
    "checkpoints": {"service", "api", "workers", "ray", "sqlalchemy"},
}
# Narrower rules within a package: (path prefix, module) pairs that are the exception.
_ALLOWED_ONLY_IN = {"ray": "service/launcher/", "torch": "checkpoints/dcp/"}


def _imported_roots(path: Path) -> set[str]:
    import ast

    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_import_table_of_the_design() -> None:
    violations = []
    for package, forbidden in _FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for root in _imported_roots(path):
                if root in forbidden:
                    violations.append(f"{rel} imports {root}")
                owner = _ALLOWED_ONLY_IN.get(root)
                if owner and owner.split("/")[0] == package and not rel.startswith(owner):
                    violations.append(f"{rel} imports {root} (only {owner} may)")
    assert violations == []
