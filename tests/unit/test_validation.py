"""Every impossible spec is a 422 whose message names the field and what is allowed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.service.settings import Settings
from tests.factories import spec_dict


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    # Validation never reaches the database, so one SQLite-backed app serves the module.
    root: Path = tmp_path_factory.mktemp("validation")
    settings = Settings(
        database_url=f"sqlite:///{root / 'db.sqlite'}",
        storage_path=root / "st",
        allowed_entrypoints=["my_pkg"],
    )
    with TestClient(create_app(settings)) as client:
        yield client


def rejected(api: TestClient, body: Any) -> str:
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    payload = response.json()
    # FastAPI's shape, plus one human line.
    assert payload["detail"] and all({"loc", "msg", "type"} <= set(d) for d in payload["detail"])
    message: str = payload["message"]
    return message


def test_min_workers_above_max_workers(api: TestClient) -> None:
    msg = rejected(api, spec_dict(scaling={"min_workers": 4, "max_workers": 2}))
    assert "scaling.min_workers" in msg and "scaling.max_workers" in msg


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("scaling", "min_workers", 0),
        ("scaling", "max_workers", -1),
        ("scaling", "cpus_per_worker", 0),
        ("training", "global_batch_size", 0),
        ("training", "micro_batch_size", -8),
        ("training", "max_steps", 0),
        ("training", "learning_rate", 0),
        ("checkpoint", "every_steps", 0),
    ],
)
def test_zero_or_negative_sizes(api: TestClient, section: str, field: str, value: int) -> None:
    msg = rejected(api, spec_dict(**{section: {field: value}}))
    assert f"{section}.{field}" in msg
    assert "greater than" in msg


def test_global_batch_not_divisible_by_micro_batch(api: TestClient) -> None:
    msg = rejected(api, spec_dict(training={"global_batch_size": 30, "micro_batch_size": 8}))
    assert "training.global_batch_size" in msg and "divisible" in msg


@pytest.mark.parametrize(
    ("field", "value"), [("pipeline_stages", 2), ("microbatches", 4), ("schedule", "1f1b")]
)
def test_pipeline_options_on_a_non_pipeline_job(api: TestClient, field: str, value: Any) -> None:
    msg = rejected(api, spec_dict(strategy={"kind": "ddp", field: value}))
    assert f"strategy.{field}" in msg and "pipeline" in msg


def test_pipeline_stages_above_max_workers(api: TestClient) -> None:
    body = spec_dict(
        strategy={"kind": "pipeline", "pipeline_stages": 4}, scaling={"max_workers": 2}
    )
    msg = rejected(api, body)
    assert "strategy.pipeline_stages" in msg and "scaling.max_workers" in msg


GPT4 = {"name": "gpt", "params": {"n_head": 4}}


@pytest.mark.parametrize(
    ("strategy", "scaling", "workload", "words"),
    [
        ({"kind": "ddp", "tensor_parallel": 2}, {}, GPT4, ["strategy.tensor_parallel", "'tp'"]),
        ({"kind": "tp"}, {}, {"name": "synthetic"}, ["strategy.tensor_parallel", "synthetic"]),
        ({"kind": "fsdp", "tensor_parallel": 3}, {"max_workers": 3}, GPT4,
         ["strategy.tensor_parallel", "n_head (4)"]),
        ({"kind": "tp", "tensor_parallel": 4}, {"max_workers": 2}, GPT4,
         ["strategy.tensor_parallel (a model split over 4", "scaling.max_workers (2)"]),
        ({"kind": "tp"}, {"min_workers": 3, "max_workers": 3}, GPT4,
         ["runs on a multiple of 2 workers", "min_workers to 2", "max_workers to 4"]),
        ({"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 2}, {"max_workers": 3},
         GPT4, ["strategy.pipeline_stages x strategy.tensor_parallel", "= 4"]),
        ({"kind": "tp", "tensor_parallel": 65}, {}, GPT4, ["strategy.tensor_parallel", "64"]),
    ],
)  # fmt: skip
def test_impossible_tensor_parallel_specs(
    api: TestClient,
    strategy: dict[str, Any],
    scaling: dict[str, Any],
    workload: dict[str, Any],
    words: list[str],
) -> None:
    msg = rejected(api, spec_dict(strategy=strategy, scaling=scaling, workload=workload))
    for word in words:
        assert word in msg, msg


@pytest.mark.parametrize(
    ("strategy", "scaling", "words"),
    [
        ({"kind": "ddp", "cpu_offload": True}, {}, "only allowed when strategy.kind is 'fsdp'"),
        ({"kind": "fsdp", "cpu_offload": True}, {}, "set scaling.use_gpu: true"),
    ],
)
def test_cpu_offload_needs_fsdp_on_a_gpu(
    api: TestClient, strategy: dict[str, Any], scaling: dict[str, Any], words: str
) -> None:
    msg = rejected(api, spec_dict(strategy=strategy, scaling=scaling))
    assert "strategy.cpu_offload" in msg and words in msg, msg


@pytest.mark.parametrize(
    "scaling",
    [
        {"use_gpu": True, "gpus_per_worker": 0.5},  # two ranks of one NCCL group on a GPU
        {"use_gpu": True, "gpus_per_worker": 2},  # a rank's second GPU would sit unused
        {"use_gpu": True},  # 0 by default
        {"use_gpu": False, "gpus_per_worker": 1},
    ],
)
def test_a_gpu_rank_owns_exactly_one_gpu(api: TestClient, scaling: dict[str, Any]) -> None:
    msg = rejected(api, spec_dict(scaling=scaling))
    assert "scaling.gpus_per_worker" in msg, msg


def test_tensor_parallel_jobs_run_at_multiples_of_the_model_size() -> None:
    from elastrain.contracts.spec import JobSpec

    tp = JobSpec.model_validate(
        spec_dict(strategy={"kind": "tp"}, scaling={"max_workers": 7}, workload=GPT4)
    )
    assert tp.world_sizes == [2, 4, 6] and tp.usable_world_size(5) == 4
    assert tp.usable_world_size(1) == 0 and tp.strategy.label == "tp2"
    three_d = JobSpec.model_validate(
        spec_dict(
            strategy={"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 2},
            scaling={"max_workers": 8},
            workload=GPT4,
        )
    )
    assert three_d.world_sizes == [4, 8] and three_d.strategy.label == "pipeline+tp2"


def test_keep_last_below_two(api: TestClient) -> None:
    msg = rejected(api, spec_dict(checkpoint={"keep_last": 1}))
    assert "checkpoint.keep_last" in msg and "2" in msg


@pytest.mark.parametrize("digest", ["md5", "XXH3", "", 3])
def test_unknown_checkpoint_digest(api: TestClient, digest: object) -> None:
    msg = rejected(api, spec_dict(checkpoint={"digest": digest}))
    assert "checkpoint.digest" in msg and "'xxh3'" in msg and "'sha256'" in msg


def test_checkpoint_digest_choices_are_the_checkpointers() -> None:
    """Every value the spec accepts names an algorithm the checkpoints can write."""
    from elastrain.checkpoints.manifest import algorithm_for_setting
    from elastrain.contracts.spec import CheckpointDigest, CheckpointSpec

    assert CheckpointSpec().digest == CheckpointDigest.xxh3
    assert {algorithm_for_setting(d.value) for d in CheckpointDigest} == {"xxh3-128", "sha256"}


def test_unknown_builtin_workload(api: TestClient) -> None:
    msg = rejected(api, spec_dict(workload={"name": "bert"}))
    assert "workload.name" in msg and "gpt" in msg and "synthetic" in msg


@pytest.mark.parametrize(
    "workload",
    [{"name": "gpt", "entrypoint": "pkg.mod:make"}, {"params": {}}],
    ids=["both", "neither"],
)
def test_both_or_neither_workload_source(api: TestClient, workload: dict[str, Any]) -> None:
    msg = rejected(api, spec_dict(workload=workload))
    assert "workload" in msg and "name" in msg and "entrypoint" in msg


@pytest.mark.parametrize("entrypoint", ["pkg.mod", "pkg.mod:", ":make", "pkg..mod:make", "a b:c"])
def test_malformed_entrypoint(api: TestClient, entrypoint: str) -> None:
    msg = rejected(api, spec_dict(workload={"entrypoint": entrypoint}))
    assert "workload.entrypoint" in msg and "package.module:factory" in msg


def test_well_formed_entrypoint_is_accepted(api: TestClient) -> None:
    body = spec_dict(workload={"entrypoint": "my_pkg.models:make_workload", "params": {"n": 1}})
    assert api.post("/v1/jobs", json=body).status_code == 201


@pytest.mark.parametrize(
    ("entrypoint", "why"),
    [
        # `os:system` with params {command: ...} would run any command on a worker.
        ("os:system", "standard library"),
        ("subprocess:run", "standard library"),
        ("importlib.util:spec_from_file_location", "standard library"),
        ("builtins:exec", "standard library"),
        # Not listed by the operator (ELASTRAIN_ALLOWED_ENTRYPOINTS=my_pkg).
        ("other_pkg.models:make", "not allowed on this service"),
        ("my_pkgx.models:make", "not allowed on this service"),  # a prefix is a module path
    ],
)
def test_refused_entrypoints(api: TestClient, entrypoint: str, why: str) -> None:
    body = spec_dict(workload={"entrypoint": entrypoint, "params": {"command": "touch /tmp/x"}})
    msg = rejected(api, body)
    assert msg.startswith("workload.entrypoint:") and why in msg, msg
    assert "ELASTRAIN_ALLOWED_ENTRYPOINTS" in msg or "standard library" in msg


@pytest.mark.parametrize(
    "entrypoint",
    [
        "elastrain.workers.workloads.synthetic:build",
        "elastrain.workers.workloads.gpt:load_corpus",
        "elastrain.workers.loop:train",
    ],
)
def test_built_in_workloads_are_reached_by_name_only(api: TestClient, entrypoint: str) -> None:
    msg = rejected(api, spec_dict(workload={"entrypoint": entrypoint}))
    assert msg.startswith("workload.entrypoint:") and "elastrain's own" in msg, msg
    assert "workload.name" in msg


def test_only_public_factories_of_allowed_modules(api: TestClient) -> None:
    for entrypoint in ("my_pkg:_helper", "my_pkg._internal:build"):
        msg = rejected(api, spec_dict(workload={"entrypoint": entrypoint}))
        assert "is private" in msg, msg


def test_the_operator_cannot_allow_the_standard_library() -> None:
    with pytest.raises(ValueError, match="standard library"):
        Settings(allowed_entrypoints=["os"])
    with pytest.raises(ValueError, match="standard library"):
        Settings(allowed_entrypoints="my_pkg, subprocess")
    with pytest.raises(ValueError, match="elastrain's own"):
        Settings(allowed_entrypoints="elastrain.workers.workloads")


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (spec_dict(gpus=4), "gpus"),
        (spec_dict(scaling={"workers": 2}), "scaling.workers"),
        (spec_dict(training={"epochs": 3}), "training.epochs"),
    ],
)
def test_unknown_fields(api: TestClient, body: dict[str, Any], path: str) -> None:
    msg = rejected(api, body)
    assert f"{path}: unknown field" in msg
    assert "allowed:" in msg


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (spec_dict(name="x" * 101), "name"),
        (spec_dict(name=""), "name"),
        (spec_dict(labels={"team": "v" * 101}), "labels.team"),
        (spec_dict(labels={"k" * 64: "v"}), "labels"),
        (spec_dict(workload={"entrypoint": "a" * 200 + ".b:make_it"}), "workload.entrypoint"),
    ],
)
def test_oversized_strings(api: TestClient, body: dict[str, Any], path: str) -> None:
    msg = rejected(api, body)
    assert path in msg


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (spec_dict(name=123), "name"),
        (spec_dict(priority="high"), "priority"),
        (spec_dict(training={"global_batch_size": "lots"}), "training.global_batch_size"),
        (spec_dict(scaling={"use_gpu": "maybe"}), "scaling.use_gpu"),
        (spec_dict(strategy={"kind": "zero3"}), "strategy.kind"),
        (spec_dict(labels=["team"]), "labels"),
        (spec_dict(workload="gpt"), "workload"),
    ],
)
def test_wrong_types(api: TestClient, body: dict[str, Any], path: str) -> None:
    msg = rejected(api, body)
    assert msg.startswith(path)


def test_enum_errors_list_the_allowed_values(api: TestClient) -> None:
    msg = rejected(api, spec_dict(strategy={"kind": "zero3"}))
    assert "'ddp'" in msg and "'fsdp'" in msg and "'pipeline'" in msg


def test_missing_required_fields(api: TestClient) -> None:
    msg = rejected(api, {"workload": {"name": "gpt"}})
    assert "name" in msg and "required" in msg.lower()


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"name: gpt-tiny\n", "application/x-yaml"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"\xff\xfe", "application/json"),
    ],
)
def test_non_json_bodies(api: TestClient, content: bytes, content_type: str) -> None:
    response = api.post("/v1/jobs", content=content, headers={"content-type": content_type})
    assert response.status_code == 422
    assert response.json()["message"].startswith("request body:")


def test_several_problems_are_all_reported(api: TestClient) -> None:
    msg = rejected(api, spec_dict(name="", priority=5000, checkpoint={"keep_last": 0}))
    assert "name" in msg and "priority" in msg and "checkpoint.keep_last" in msg


def test_mixed_precision_needs_a_gpu(api: TestClient) -> None:
    msg = rejected(api, spec_dict(strategy={"mixed_precision": "bf16"}))
    assert "strategy.mixed_precision" in msg


def test_unexpected_errors_are_500_without_a_traceback(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_path=tmp_path)
    app = create_app(settings)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals at /etc/shadow")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json() == {"detail": "internal server error"}
    assert "shadow" not in response.text


@pytest.mark.parametrize(
    ("scaling", "field", "words"),
    [
        ({"cpus_per_worker": 0.001}, "scaling.cpus_per_worker", "greater than or equal to 0.01"),
        ({"cpus_per_worker": 5e-324}, "scaling.cpus_per_worker", "0.01"),
        ({"cpus_per_worker": 513}, "scaling.cpus_per_worker", "less than or equal to 512"),
        ({"max_workers": 1025}, "scaling.max_workers", "1024"),
        ({"use_gpu": True, "gpus_per_worker": 0.3}, "scaling.gpus_per_worker", "must be 1"),
        ({"use_gpu": True, "gpus_per_worker": 1e-9}, "scaling.gpus_per_worker", "must be 1"),
        (
            {"use_gpu": True, "gpus_per_worker": 1.5},
            "scaling.gpus_per_worker",
            "less than or equal to 1",
        ),
    ],
)
def test_resources_a_cluster_cannot_mean(
    api: TestClient, scaling: dict[str, Any], field: str, words: str
) -> None:
    msg = rejected(api, spec_dict(scaling=scaling))
    assert field in msg and words in msg, msg


def test_a_gpu_rank_holds_one_whole_gpu() -> None:
    from elastrain.contracts.spec import ScalingSpec

    assert ScalingSpec(use_gpu=True, gpus_per_worker=1).gpus_per_worker == 1


def test_a_pipeline_split_the_model_cannot_have_is_refused_at_submit(api: TestClient) -> None:
    msg = rejected(
        api,
        spec_dict(
            workload={"name": "gpt", "params": {"n_layer": 2}},
            strategy={"kind": "pipeline", "pipeline_stages": 4},
            scaling={"min_workers": 4, "max_workers": 4, "cpus_per_worker": 0.5},
        ),
    )
    assert "strategy.pipeline_stages" in msg and "at most 2" in msg, msg


def _gpt(**params: Any) -> dict[str, Any]:
    return {"name": "gpt", "params": {"n_layer": 4, "n_embd": 48, "n_head": 6, **params}}


SYNTHETIC = {"name": "synthetic", "params": {"n_layer": 3}}


#: (strategy, scaling, training, workload, the field a 422 names; None: accepted). What the
#: runtime needs of a split (read from workers/strategies and the built-in models): whole
#: blocks per pipeline stage, whole heads per tensor-parallel rank, whole model replicas
#: per world size; it does NOT need the vocabulary or positions to divide (DTensor shards
#: rows unevenly), the global batch to divide over the replicas (shares differ by one,
#: empty ones join with zeros), nor the micro-batch count to fill the pipeline.
SPLITS = [
    # Pipeline: a stage takes whole blocks.
    ({"kind": "pipeline", "pipeline_stages": 4}, {"max_workers": 4}, {}, _gpt(n_layer=3),
     "strategy.pipeline_stages"),
    ({"kind": "pipeline", "pipeline_stages": 4}, {"max_workers": 4}, {}, SYNTHETIC,
     "strategy.pipeline_stages"),
    ({"kind": "pipeline", "pipeline_stages": 3}, {"max_workers": 3}, {}, _gpt(n_layer=3), None),
    # Tensor parallel: each rank runs whole heads (and so a whole share of n_embd and MLP).
    ({"kind": "tp", "tensor_parallel": 4}, {"max_workers": 4}, {}, _gpt(), "strategy.tensor_parallel"),
    ({"kind": "fsdp", "tensor_parallel": 4}, {"max_workers": 4}, {}, _gpt(),
     "strategy.tensor_parallel"),
    ({"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 4}, {"max_workers": 8}, {},
     _gpt(), "strategy.tensor_parallel"),
    ({"kind": "tp", "tensor_parallel": 2}, {"max_workers": 2}, {}, SYNTHETIC,
     "strategy.tensor_parallel"),
    ({"kind": "tp", "tensor_parallel": 3}, {"max_workers": 3}, {}, _gpt(), None),
    ({"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 3}, {"max_workers": 6}, {},
     _gpt(), None),
    # Whole replicas: some world size in min..max must be a multiple of stages x degree.
    ({"kind": "tp", "tensor_parallel": 3}, {"min_workers": 4, "max_workers": 5}, {}, _gpt(),
     "scaling"),
    ({"kind": "pipeline", "pipeline_stages": 2, "tensor_parallel": 3}, {"max_workers": 5}, {},
     _gpt(), "strategy.pipeline_stages x strategy.tensor_parallel"),
    ({"kind": "tp", "tensor_parallel": 3}, {"min_workers": 1, "max_workers": 7}, {}, _gpt(),
     None),
    # Batches: micro-batches cut the global batch; replicas need not divide it.
    ({"kind": "ddp"}, {"max_workers": 4}, {"global_batch_size": 12, "micro_batch_size": 8},
     _gpt(), "training.global_batch_size"),
    ({"kind": "ddp"}, {"max_workers": 4}, {"global_batch_size": 2, "micro_batch_size": 2},
     _gpt(), None),
    ({"kind": "pipeline", "pipeline_stages": 2, "microbatches": 64}, {"max_workers": 4},
     {"global_batch_size": 6, "micro_batch_size": 3}, _gpt(), None),
    # Precision: pipeline stages autocast to bf16; fp16 would need loss scaling in them.
    ({"kind": "pipeline", "mixed_precision": "bf16"},
     {"use_gpu": True, "gpus_per_worker": 1}, {}, _gpt(), None),
    ({"kind": "pipeline", "mixed_precision": "fp16"},
     {"use_gpu": True, "gpus_per_worker": 1}, {}, _gpt(), "strategy.mixed_precision"),
    ({"kind": "fsdp", "mixed_precision": "bf16"},
     {"use_gpu": True, "gpus_per_worker": 1}, {}, _gpt(), None),
]  # fmt: skip


@pytest.mark.parametrize(("strategy", "scaling", "training", "workload", "field"), SPLITS)
def test_every_split_the_model_cannot_have_is_a_422_naming_the_field(
    api: TestClient,
    strategy: dict[str, Any],
    scaling: dict[str, Any],
    training: dict[str, Any],
    workload: dict[str, Any],
    field: str | None,
) -> None:
    body = spec_dict(
        strategy=strategy,
        scaling={"cpus_per_worker": 0.1, **scaling},
        training=training,
        workload=workload,
    )
    if field is None:
        made = api.post("/v1/jobs", json=body)
        assert made.status_code == 201, made.text
        return
    msg = rejected(api, body)
    assert msg.startswith(f"{field}") or f" {field}" in msg or f"{field} " in msg, msg
