"""`/v1/packages` and jobs that name a package, through FastAPI (SQLite and PostgreSQL).

No Ray here: what a worker does with the package is in tests/unit/test_packages.py and
tests/integration/test_working_dir.py.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.service.settings import Settings
from tests.factories import a_zip, spec_dict

ZIP = {"Content-Type": "application/zip"}


MODEL = {"my_model.py": "def build(): ...\n", "my_lib/__init__.py": "", "my_lib/layers.py": ""}


def upload(client: TestClient, files: dict[str, Any] = MODEL) -> dict[str, Any]:
    response = client.post("/v1/packages", content=a_zip(files), headers=ZIP)
    assert response.status_code in (200, 201), response.text
    body: dict[str, Any] = response.json()
    return body


def package_spec(digest: str, entrypoint: str = "my_model:build", **workload: Any) -> dict:  # type: ignore[type-arg]
    return spec_dict(
        name="own-code",
        workload={"entrypoint": entrypoint, "package": digest, **workload},
    )


def test_upload_is_content_addressed_and_idempotent(client: TestClient, settings: Settings) -> None:
    first = client.post("/v1/packages", content=a_zip(MODEL), headers=ZIP)
    assert first.status_code == 201
    body = first.json()
    assert body["digest"].startswith("sha256:") and body["file_count"] == 3
    assert first.headers["location"] == f"/v1/packages/{body['digest']}"
    assert {f["path"] for f in body["files"]} == set(MODEL)
    again = client.post("/v1/packages", content=a_zip(MODEL), headers=ZIP)
    assert again.status_code == 200 and again.json() == body
    looked_up = client.get(f"/v1/packages/{body['digest']}").json()
    assert looked_up == {**body, "grants": looked_up["grants"]}  # an admin sees who holds it
    assert [g["tenant"] for g in looked_up["grants"]] == ["default"]
    stored = settings.storage_path / "packages" / body["digest"].removeprefix("sha256:")
    assert (stored / "files" / "my_lib" / "layers.py").is_file()
    missing = client.get("/v1/packages/sha256:" + "0" * 64)
    assert missing.status_code == 404
    assert client.get("/v1/packages/md5:abc").status_code == 422


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"),
    [
        (a_zip(MODEL), {"Content-Type": "application/json"}, 415, "application/zip"),
        (a_zip(MODEL), {}, 415, "application/zip"),
        (b"definitely not a zip", ZIP, 422, "not a zip"),
        (a_zip({"../../escape.py": "x"}), ZIP, 422, "'..'"),
        (a_zip({"/etc/cron.d/x": "x"}), ZIP, 422, "absolute"),
    ],
    ids=["json-type", "no-type", "not-zip", "zip-slip", "absolute"],
)
def test_bad_uploads_get_a_4xx_with_the_reason(
    client: TestClient,
    settings: Settings,
    body: bytes,
    headers: dict,
    status: int,
    words: str,  # type: ignore[type-arg]
) -> None:
    response = client.post("/v1/packages", content=body, headers=headers)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]
    packages = settings.storage_path / "packages"
    assert not packages.exists() or list(packages.iterdir()) == []
    assert not (settings.storage_path.parent / "escape.py").exists()


def test_an_upload_over_the_limit_is_413_and_stores_nothing(settings: Settings) -> None:
    small = settings.model_copy(update={"max_package_bytes": 10_000})
    big = a_zip({"weights.bin": random.Random(0).randbytes(100_000)})  # incompressible
    with TestClient(create_app(small, start_scheduler=False)) as client:
        declared = client.post("/v1/packages", content=big, headers=ZIP)
        assert declared.status_code == 413 and "10000 bytes" in declared.json()["detail"]

        def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096]

        streamed = client.post("/v1/packages", content=chunks(), headers=ZIP)  # no length
        assert streamed.status_code == 413
    packages = settings.storage_path / "packages"
    assert not packages.exists() or list(packages.iterdir()) == []


def test_a_job_names_an_uploaded_package(client: TestClient) -> None:
    digest = upload(client)["digest"]
    job = client.post("/v1/jobs", json=package_spec(digest))
    assert job.status_code == 201, job.text
    assert job.json()["spec"]["workload"]["package"] == digest
    nested = client.post("/v1/jobs", json=package_spec(digest, "my_lib.layers:build"))
    assert nested.status_code == 201, nested.text


@pytest.mark.parametrize(
    ("workload", "field", "words"),
    [
        ({"package": "sha256:" + "a" * 64}, "workload.package", "no package"),
        ({"entrypoint": "other_model:build"}, "workload.entrypoint", "is not in package"),
        ({"entrypoint": "json:loads"}, "workload.entrypoint", "standard-library"),
        ({"entrypoint": "elastrain.x:build"}, "workload.entrypoint", "elastrain module"),
        ({"package": "sha256:abc"}, "workload.package", "should match pattern"),
        ({"entrypoint": None, "name": "gpt"}, "workload.package", "needs workload.entrypoint"),
        ({"requirements": ["--index-url=http://evil"]}, "workload.requirements.0", "pattern"),
        ({"requirements": ["https://evil/x.whl"]}, "workload.requirements.0", "pattern"),
    ],
)
def test_bad_package_references_are_422_naming_the_field(
    client: TestClient,
    workload: dict,
    field: str,
    words: str,  # type: ignore[type-arg]
) -> None:
    digest = upload(client)["digest"]
    spec = package_spec(digest)
    spec["workload"] = {k: v for k, v in {**spec["workload"], **workload}.items() if v is not None}
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert field in message and words in message, message


def test_requirements_are_stored_with_the_job(client: TestClient) -> None:
    digest = upload(client)["digest"]
    spec = package_spec(digest, requirements=["einops==0.8.1", "rich[jupyter]>=13,<15"])
    job = client.post("/v1/jobs", json=spec)
    assert job.status_code == 201, job.text
    assert job.json()["spec"]["workload"]["requirements"] == spec["workload"]["requirements"]


@pytest.mark.parametrize(
    ("scaling", "stages", "words"),
    [
        ({"min_workers": 3, "max_workers": 3}, 2, "none lies in min_workers..max_workers (3..3)"),
        ({"min_workers": 5, "max_workers": 7}, 4, "none lies in min_workers..max_workers (5..7)"),
        ({"min_workers": 1, "max_workers": 2}, 3, "must be <= scaling.max_workers"),
    ],
)
def test_a_pipeline_no_world_size_can_run_is_422(
    client: TestClient,
    scaling: dict,
    stages: int,
    words: str,  # type: ignore[type-arg]
) -> None:
    spec = spec_dict(
        name="pp", strategy={"kind": "pipeline", "pipeline_stages": stages}, scaling=scaling
    )
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert words in response.json()["message"]


def test_a_pipeline_some_world_size_can_run_is_accepted(client: TestClient) -> None:
    spec = spec_dict(
        name="pp",
        strategy={"kind": "pipeline", "pipeline_stages": 2},
        scaling={"min_workers": 3, "max_workers": 4},
    )
    assert client.post("/v1/jobs", json=spec).status_code == 201


def test_the_cli_uploads_a_working_dir_once(tmp_path: Path, client: TestClient) -> None:
    """`submit --working-dir` packs, uploads unless already there, and names the digest."""
    from typer.testing import CliRunner

    from elastrain.api import cli

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "my_model.py").write_text("def build(): ...\n")
    (project / "data" / "huge.bin").write_bytes(b"0" * 1000)
    (project / ".elastrainignore").write_text("data/\n")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text('{"name": "wd", "workload": {"entrypoint": "my_model:build"}}')

    calls: list[str] = []

    class Recording(cli.Api):
        def __init__(self, url: str, token: str | None) -> None:
            super().__init__(url, token)
            self.http = client  # the app in-process, same interface as httpx.Client

        def call(self, method: str, path: str, **kwargs: Any) -> Any:
            calls.append(f"{method} {path}")
            return super().call(method, path, **kwargs)

    runner = CliRunner()
    original = cli.Api
    cli.Api = Recording  # type: ignore[misc]
    try:
        first = runner.invoke(cli.app, ["submit", str(spec_file), "--working-dir", str(project)])
        second = runner.invoke(cli.app, ["submit", str(spec_file), "-w", str(project)])
        nothing = runner.invoke(cli.app, ["submit", str(spec_file), "-w", str(tmp_path / "no")])
    finally:
        cli.Api = original  # type: ignore[misc]
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert calls == ["POST /v1/packages", "POST /v1/jobs", "POST /v1/jobs"]  # uploaded once
    # The digest as the CLI printed it (found, not cut by position: a logging handler an
    # earlier test left on a closed stream may write before it in the same capture).
    digest = re.search(r"package (sha256:[0-9a-f]{64})", first.stderr).group(1)  # type: ignore[union-attr]
    files = client.get(f"/v1/packages/{digest}").json()["files"]
    assert [f["path"] for f in files] == [".elastrainignore", "my_model.py"]
    job_id = int(first.stdout.split()[0])
    assert client.get(f"/v1/jobs/{job_id}").json()["spec"]["workload"]["package"] == digest
    assert nothing.exit_code == 2 and "is not a directory" in nothing.stderr


def test_gpt_data_paths_are_checked_at_submit(client: TestClient, settings: Settings) -> None:
    def gpt(**params: Any) -> dict:  # type: ignore[type-arg]
        return spec_dict(name="own-data", workload={"name": "gpt", "params": params})

    missing = client.post("/v1/jobs", json=gpt(data_path="data/train.bin", token_dtype="uint16",
                                               vocab_size=65))  # fmt: skip
    assert missing.status_code == 422
    body = missing.json()
    assert body["detail"][0]["loc"] == ["body", "workload", "params", "data_path"]
    assert "workload.params.data_path: 'data/train.bin' does not exist" in body["message"]
    escape = client.post("/v1/jobs", json=gpt(data_path="../../etc/passwd"))
    assert escape.status_code == 422 and "'..' is not allowed" in escape.json()["message"]

    own = settings.storage_path / "data" / "default" / "data"  # the default tenant's area
    own.mkdir(parents=True)
    (own / "train.bin").write_bytes(bytes(range(64)) * 100)
    ok = client.post("/v1/jobs", json=gpt(data_path="data/train.bin", token_dtype="uint16",
                                          vocab_size=65536))  # fmt: skip
    assert ok.status_code == 201, ok.text
