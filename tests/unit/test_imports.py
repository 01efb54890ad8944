"""Import hygiene: the API and the service never load torch, nor the API Ray;
the shared contracts load none of the heavy packages.

Each check runs in a fresh interpreter (this one has loaded who knows what). Modules are
imported one at a time and `sys.modules` is checked after each, so a failure names the
first module that pulled the forbidden package in.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import re
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
        importlib.import_module("elastrain.api.main").create_app()
    else:
        importlib.import_module(step)
    layers = {m.split(".")[1] if m.startswith("elastrain.") else m.split(".")[0]
              for m in sys.modules}
    report[step] = sorted(layers & forbidden)
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
    steps = ["elastrain.api.main", "elastrain.api.cli", "elastrain.api.routes.jobs", "create_app"]
    assert _first_offender(steps, {"torch", "ray", "workers"}) == {}


def test_tracker_clients_load_only_when_a_job_uses_them() -> None:
    # mlflow and wandb are optional extras, and heavy: the service starts without them.
    steps = [
        "elastrain.api.main",
        "create_app",
        "elastrain.service.scheduler",
        "elastrain.service.tracking.forwarder",
    ]
    assert _first_offender(steps, {"mlflow", "wandb"}) == {}


def _service_modules() -> list[str]:
    import elastrain.service

    names = [
        m.name for m in pkgutil.walk_packages(elastrain.service.__path__, "elastrain.service.")
    ]
    return sorted(n for n in names if not n.startswith("elastrain.service.migrations"))


def test_contracts_load_nothing_heavy() -> None:
    steps = [
        "elastrain.contracts.spec",
        "elastrain.contracts.messages",
        "elastrain.contracts.storage",
    ]
    assert _first_offender(steps, {"torch", "ray", "sqlalchemy", "numpy"}) == {}


def test_service_does_not_load_torch() -> None:
    modules = _service_modules()
    assert "elastrain.service.jobs" in modules and "elastrain.service.runtime_client" in modules
    modules.remove("elastrain.service.runtime_client")
    assert _first_offender(modules, {"torch", "api", "workers"}) == {}
    # The runtime client imports the runtime actor's class and the export task (its
    # edges into `workers`) and nothing a rank runs: no torch, no worker process, no training loop.
    assert _first_offender(["elastrain.service.runtime_client"], {"torch", "api"}) == {}
    loaded = _loaded_by("elastrain.service.runtime_client", "elastrain.workers")
    assert loaded == ["elastrain.workers", "elastrain.workers.export_task", "elastrain.workers.runtime", "elastrain.workers.runtime.actor",
                      "elastrain.workers.runtime.attempts", "elastrain.workers.runtime.collect",
                      "elastrain.workers.runtime.driver", "elastrain.workers.runtime.guard",
                      "elastrain.workers.runtime.hangs", "elastrain.workers.runtime.layout",
                      "elastrain.workers.runtime.liveness",
                      "elastrain.workers.runtime.notice", "elastrain.workers.runtime.ordering",
                      "elastrain.workers.runtime.phases", "elastrain.workers.runtime.placement",
                      "elastrain.workers.runtime.pool",
                      "elastrain.workers.runtime.reconcile",
                      "elastrain.workers.runtime.stragglers",
                      "elastrain.workers.runtime.verdict"]  # fmt: skip


def _loaded_by(module: str, prefix: str) -> list[str]:
    """The modules under `prefix` that importing `module` loads (fresh interpreter)."""
    probe = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        f"print(json.dumps(sorted(m for m in sys.modules "
        f"if m == {prefix!r} or m.startswith({prefix + '.'!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded: list[str] = json.loads(out.strip().splitlines()[-1])
    return loaded


# The import table, checked statically over every source file: who may
# import what, including imports inside functions and modules named in strings.
_FIRST_PARTY = {"api", "service", "workers", "contracts", "checkpoints"}
_FORBIDDEN: dict[str, set[str]] = {
    # Shared by every other package across process boundaries: stdlib and pydantic only.
    "contracts": {"torch", "ray", "sqlalchemy", "service", "api", "workers", "checkpoints"},
    "api": {"torch", "ray", "workers"},
    "service": {"torch", "workers", "api"},
    "workers": {"sqlalchemy", "service", "api"},
    "checkpoints": {"service", "api", "workers", "ray", "sqlalchemy"},
}
# Narrower rules within a package: a module only the named files (or folders, ending in
# "/") may import.
_ALLOWED_ONLY_IN = {
    "ray": ("service/runtime_client.py",),  # the control plane's one client of the runtime
    "torch": ("checkpoints/dcp/",),
}
# The exceptions to _FORBIDDEN, each exactly one module edge: (file, module it imports).
_EDGES_ALLOWED = {
    # The runtime actor's class, to create the actor: its module loads no torch (tested above).
    ("service/runtime_client.py", "elastrain.workers.runtime.actor"),
    # The export task, run on the cluster: its module loads no torch (tested above).
    ("service/runtime_client.py", "elastrain.workers.export_task"),
    # Built-in workloads named as entrypoints in the job spec: data the workers import
    # themselves (`elastrain.workers.workloads.load_workload`), never imported where they are named.
    ("contracts/spec.py", "elastrain.workers.workloads.gpt"),
    ("contracts/spec.py", "elastrain.workers.workloads.hf_causal_lm"),
    ("contracts/spec.py", "elastrain.workers.workloads.synthetic"),
    ("contracts/spec.py", "elastrain.workers.prepare"),
    ("contracts/bounds.py", "elastrain.workers.workloads"),
}
# A string that names a first-party module ("pkg.mod" or "pkg.mod:attr"): an import by string.
_MODULE_STRING = re.compile(rf"^elastrain\.({'|'.join(sorted(_FIRST_PARTY))})(\.\w+)*(:\w+)?$")


def _layer(module: str) -> str:
    """The package a module belongs to: `elastrain.service.x` -> service, `torch.nn` -> torch."""
    parts = module.split(".")
    return parts[1] if parts[0] == "elastrain" and len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (at any depth, in functions too) or names in a string."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE_STRING.match(node.value)
        ):
            modules.add(node.value.split(":")[0])
    return modules


def _violations(package: str, rel: str, modules: set[str]) -> list[str]:
    found = []
    for module in sorted(modules):
        root = _layer(module)
        if root in _FORBIDDEN[package] and (rel, module) not in _EDGES_ALLOWED:
            found.append(f"{rel} imports {module}")
        owners = _ALLOWED_ONLY_IN.get(root, ())
        if owners and owners[0].split("/")[0] == package and not _owned_by(rel, owners):
            found.append(f"{rel} imports {root} (only {', '.join(owners)} may)")
    return found


def _owned_by(rel: str, owners: tuple[str, ...]) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in owners)


def test_import_table_of_the_design() -> None:
    violations = []
    for package in _FORBIDDEN:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            violations += _violations(package, rel, _imports(path))
    assert violations == []


def test_the_import_table_sees_imports_by_string_and_in_functions(tmp_path: Path) -> None:
    """The check above fails on each way a layer could reach up or across."""
    sources = {
        "import elastrain.workers.process": ["service/x.py imports elastrain.workers.process"],
        "def f():\n    from elastrain.api import main": ["service/x.py imports elastrain.api"],
        'WORKER = "elastrain.workers.process:WorkerProcess"': [
            "service/x.py imports elastrain.workers.process"
        ],
        'importlib.import_module("elastrain.workers.loop")': [
            "service/x.py imports elastrain.workers.loop"
        ],
        "import ray": ["service/x.py imports ray (only service/runtime_client.py may)"],
        '"""Docs naming `elastrain.workers.process` in prose are fine."""': [],
    }
    for source, expected in sources.items():
        path = tmp_path / "x.py"
        path.write_text(source + "\n")
        assert _violations("service", "service/x.py", _imports(path)) == expected, source
    assert (
        _violations(
            "service", "service/runtime_client.py", {"elastrain.workers.runtime.actor", "ray"}
        )
        == []
    )
    assert _violations("service", "service/runtime_client.py", {"elastrain.workers.process"}) == [
        "service/runtime_client.py imports elastrain.workers.process"
    ]


def test_nothing_imports_the_old_top_level_names() -> None:
    """Everything is `elastrain.<package>`: an import of a bare `service`, `workers`... would
    load a second copy of the module (or a user's module of that name in a worker)."""
    found = []
    for folder in [*sorted(_FIRST_PARTY), "tests", "bench", "examples", "elastrain"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "elastrain") and path.parent != ROOT / "elastrain":
                continue  # the links to the packages: checked under their own names
            for module in _imports(path):
                if module.split(".")[0] in _FIRST_PARTY:
                    found.append(f"{path.relative_to(ROOT)} imports {module}")
    assert found == []
