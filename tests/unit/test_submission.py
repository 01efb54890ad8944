"""The submission policy's decisions (`elastrain.service.submission`), as tables: what each
refuses, at which spec field, in which words. The API's answers to the same refusals (422
and 429, their `message`) are tested through the routes (test_validation, test_packages_api,
test_plan_api, test_tracking_spec, test_os_identity, test_shared_state_bounds)."""

from __future__ import annotations

from typing import Any

import pytest

from elastrain.contracts.os_identity import RunAs
from elastrain.contracts.packages import FileEntry, Manifest
from elastrain.contracts.spec import JobSpec
from elastrain.service.submission import (
    Problem,
    auto_problems,
    entrypoint_problems,
    identity_problems,
    package_module_problems,
    private_problems,
    problems_at_their_fields,
    queue_is_full,
    script_problems,
    tracker_problems,
)
from elastrain.service.tracking.destinations import origin_of
from tests.factories import spec_dict

DIGEST = "a" * 64
GIB = 2**30


def _manifest(*paths: str) -> Manifest:
    return Manifest.of(FileEntry(path=p, size=1, sha256="0" * 64) for p in paths)


def _fields(problems: list[Problem]) -> list[tuple[str | int, ...]]:
    return [p.field for p in problems]


@pytest.mark.parametrize(
    ("entrypoint", "allowed", "message"),
    [
        (None, [], None),  # a built-in: named, not an entrypoint
        ("team.models:build", ["team"], None),
        ("team.models:build", ["team.models"], None),
        ("teamx.models:build", ["team"], "module 'teamx.models' is not allowed on this service"),
        ("os:system", ["os"], "module 'os' is in the Python standard library"),
        ("elastrain.workers.workloads.gpt:build", ["elastrain"], "is elastrain's own"),
        ("team.models:_hidden", ["team"], "'_hidden' is private"),
    ],
)
def test_an_installed_entrypoint_is_one_the_operator_allows(
    entrypoint: str | None, allowed: list[str], message: str | None
) -> None:
    problems = entrypoint_problems(entrypoint, allowed)
    if message is None:
        assert problems == []
    else:
        assert _fields(problems) == [("workload", "entrypoint")]
        assert problems[0].message.startswith("workload.entrypoint: ")
        assert message in problems[0].message


@pytest.mark.parametrize(
    ("entrypoint", "private"),
    [("m:build", None), ("m:_build", "'_build'"), ("_m:build", "'_m'"), ("pkg._x.m:f", "'_x'")],
)
def test_a_package_runs_public_factories_only(entrypoint: str, private: str | None) -> None:
    problems = private_problems(entrypoint)
    if private is None:
        assert problems == []
    else:
        assert problems == [
            Problem(
                ("workload", "entrypoint"),
                f"workload.entrypoint: {private} is private (it starts with '_'); only public "
                "factories can run",
            )
        ]


@pytest.mark.parametrize(
    ("entrypoint", "files", "message"),
    [
        ("my_model:build", ["my_model.py"], None),
        ("my_lib.layers:build", ["my_lib/__init__.py", "my_lib/layers.py"], None),
        (
            "json:load",
            ["json.py"],
            "workload.entrypoint: module 'json' has the name of a standard-library or elastrain "
            "module; rename it in your package",
        ),
        (
            "elastrain.mine:build",
            ["elastrain/mine.py"],
            "workload.entrypoint: module 'elastrain.mine' has the name of a standard-library "
            "or elastrain module; rename it in your package",
        ),
        (
            "other:build",
            ["my_model.py", "b.py"],
            f"workload.entrypoint: module 'other' is not in package {DIGEST} (its modules: "
            "b, my_model)",
        ),
        (
            "other:build",
            ["README.md"],
            f"workload.entrypoint: module 'other' is not in package {DIGEST} (its modules: none)",
        ),
    ],
)
def test_a_packaged_entrypoint_names_a_module_of_the_package(
    entrypoint: str, files: list[str], message: str | None
) -> None:
    problems = package_module_problems(entrypoint, DIGEST, _manifest(*files))
    expected = [] if message is None else [Problem(("workload", "entrypoint"), message)]
    assert problems == expected


@pytest.mark.parametrize(
    ("script", "files", "message"),
    [
        (None, ["train.py"], None),  # a module or a program on the PATH
        ("train.py", ["train.py"], None),
        ("./run.sh", ["run.sh"], None),
        ("sub/train.py", ["sub/train.py"], None),
        (
            "trian.py",
            ["train.py", "a.py"],
            f"workload.command: 'trian.py' is not in package {DIGEST} (its files: a.py, train.py)",
        ),
        ("x.py", [], f"workload.command: 'x.py' is not in package {DIGEST} (its files: none)"),
    ],
)
def test_a_command_script_is_a_file_of_its_package(
    script: str | None, files: list[str], message: str | None
) -> None:
    problems = script_problems(script, DIGEST, _manifest(*files))
    expected = [] if message is None else [Problem(("workload", "command"), message)]
    assert problems == expected


def test_data_problems_sit_at_the_field_their_message_names() -> None:
    messages = [
        "workload.params.data_path: 'x.bin' does not exist in your data area",
        "workload.params.eval_path: 'y' is not a regular file",
    ]
    assert problems_at_their_fields(messages) == [
        Problem(("workload", "params", "data_path"), messages[0]),
        Problem(("workload", "params", "eval_path"), messages[1]),
    ]
    assert problems_at_their_fields([]) == []


BIG_GPT = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 1024}


def _big_gpt(kind: str) -> JobSpec:
    return JobSpec.model_validate(
        spec_dict(
            workload={"name": "gpt", "params": BIG_GPT},
            strategy={"kind": kind},
            scaling={"min_workers": 1, "max_workers": 8},
            training={"global_batch_size": 32, "micro_batch_size": 4,
                      "activation_checkpointing": "full"},
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "memory", "refused"),
    [
        (_big_gpt("auto"), None, False),  # memory unknown now: planned at launch
        (_big_gpt("auto"), 64 * GIB, False),
        (_big_gpt("auto"), 2 * GIB, True),
        (_big_gpt("ddp"), 2 * GIB, False),  # not auto: the user chose
    ],
)
def test_an_auto_job_must_fit_at_some_world_size(
    spec: JobSpec, memory: int | None, refused: bool
) -> None:
    problems = auto_problems(spec, memory)
    if not refused:
        assert problems == []
        return
    assert _fields(problems) == [("strategy", "kind")]
    assert problems[0].message.startswith(
        "strategy.kind: auto: nothing fits 1.80 GiB per worker at world size 8"
    )


MLFLOW_OWN = "file:///srv/mlruns"
ALLOWED = [origin_of("https://mlflow.example.com")]


@pytest.mark.parametrize(
    ("tracking", "missing", "fields"),
    [
        ({}, {}, []),
        ({"mlflow": {"experiment": "e"}}, {}, []),  # the operator's own tracker
        ({"mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "e"}}, {}, []),
        (
            {"mlflow": {"tracking_uri": "https://evil.example.com", "experiment": "e"}},
            {"mlflow": "elastrain[mlflow]"},
            [("tracking", "mlflow", "tracking_uri")],  # the destination first, alone
        ),
        (
            {"mlflow": {"experiment": "e"}, "wandb": {"project": "p", "mode": "offline"}},
            {"mlflow": "elastrain[mlflow]", "wandb": "elastrain[wandb]"},
            [("tracking", "mlflow"), ("tracking", "wandb")],
        ),
    ],
)
def test_trackers_are_allowed_destinations_with_their_clients_installed(
    tracking: dict[str, Any], missing: dict[str, str], fields: list[tuple[str, ...]]
) -> None:
    spec = JobSpec.model_validate(spec_dict(tracking=tracking))
    problems = tracker_problems(spec, allowed=ALLOWED, operator_uri=MLFLOW_OWN, missing=missing)
    assert _fields(problems) == fields
    for problem in problems:
        assert problem.message.startswith(".".join(str(p) for p in problem.field) + ":")
    if fields == [("tracking", "mlflow"), ("tracking", "wandb")]:
        assert problems[1].message == (
            "tracking.wandb: install elastrain[wandb] on the control plane (the service "
            "forwards to wandb; its client package is missing)"
        )


@pytest.mark.parametrize(
    ("queued", "limit", "full"), [(0, 1, False), (4, 5, False), (5, 5, True), (9, 5, True)]
)
def test_a_tenants_queue_is_bounded(queued: int, limit: int, full: bool) -> None:
    assert queue_is_full(queued, limit) is full


SCRIPT = {"command": ["sh", "-c", "true"]}
IDS = {"alice": RunAs(uid=1001, gid=1001)}


@pytest.mark.parametrize(
    ("workload", "tenant", "mapping_on", "refused"),
    [
        (SCRIPT, "bob", False, False),  # no mapping: scripts run as the workers' user
        (SCRIPT, "alice", True, False),
        (SCRIPT, "bob", True, True),
        ({"name": "synthetic", "params": {}}, "bob", True, False),  # a built-in: no script
    ],
)
def test_a_script_needs_its_tenants_os_identity_while_tenants_are_mapped(
    workload: dict[str, Any], tenant: str, mapping_on: bool, refused: bool
) -> None:
    spec = JobSpec.model_validate(spec_dict(workload=workload))
    problems = identity_problems(spec, tenant, mapping_on=mapping_on, identities=IDS)
    expected = (
        [
            Problem(
                ("workload", "command"),
                f"workload.command: tenant {tenant!r} has no OS identity to run scripts as "
                "(the operator's ELASTRAIN_TENANT_USERS); use a built-in workload",
            )
        ]
        if refused
        else []
    )
    assert problems == expected
