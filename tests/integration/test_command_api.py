"""Command jobs (`workload.command`) at the API: what is accepted, and 422s that name the
field (no Ray here: tests/integration/test_command_ray.py runs them)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import spec_dict
from tests.integration.test_packages_api import upload

SCRIPT = {"train.py": "print('hi')\n", "lib/util.py": ""}


def command_spec(**workload: Any) -> dict[str, Any]:
    spec = spec_dict(name="byo", workload=workload)
    spec.pop("strategy", None)
    return spec


def test_a_command_with_its_package_is_accepted_and_stored(client: TestClient) -> None:
    digest = upload(client, SCRIPT)["digest"]
    command = ["python", "train.py", "--lr", "3e-4"]
    response = client.post("/v1/jobs", json=command_spec(command=command, package=digest))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["workload"]["command"] == command
    # A module or a program of the workers needs no package.
    response = client.post("/v1/jobs", json=command_spec(command=["python", "-m", "mymod"]))
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    ("workload", "field", "words"),
    [
        ({"command": []}, "workload.command", "non-empty list of strings"),
        ({"command": "python train.py"}, "workload.command", "valid list"),
        ({"command": ["python", 3]}, "workload.command.1", "valid string"),
        ({"command": [""]}, "workload.command", "non-empty list"),
        ({"command": ["python", "-c", "1"], "name": "gpt"}, "workload.command", "exclusive"),
        ({"command": ["python", "-c", "1"], "entrypoint": "m:f"}, "workload.command", "exclusive"),
        ({"command": ["python", "train.py"]}, "workload.package", "--working-dir"),
        ({"command": ["./run.sh"]}, "workload.package", "'./run.sh'"),
        ({"command": ["python", "-c", "1"], "params": {"a": 1}}, "workload.params", "command"),
        ({"command": ["python", "/etc/x.py"], "package": True}, "workload.command", "inside"),
        ({"command": ["python", "nope.py"], "package": True}, "workload.command", "not in package"),
    ],
)
def test_bad_commands_are_422_naming_the_field(
    client: TestClient, workload: dict[str, Any], field: str, words: str
) -> None:
    if workload.get("package") is True:
        workload = {**workload, "package": upload(client, SCRIPT)["digest"]}
    response = client.post("/v1/jobs", json=command_spec(**workload))
    assert response.status_code == 422, response.text
    body = response.json()
    text = body["message"] + str(body.get("detail", ""))
    assert field in text and words in text, body


def test_a_command_job_leaves_strategy_to_its_script(client: TestClient) -> None:
    spec = command_spec(command=["python", "-c", "1"])
    spec["strategy"] = {"kind": "fsdp"}
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    assert "strategy: a command job" in response.json()["message"]


def test_checkpoint_now_is_a_conflict_for_a_command_job(client: TestClient, app_sessions) -> None:  # type: ignore[no-untyped-def]
    from elastrain.service.models import Job
    from elastrain.service.states import JobState

    job_id = client.post("/v1/jobs", json=command_spec(command=["python", "-c", "1"])).json()["id"]
    with app_sessions() as session:
        session.get(Job, job_id).state = JobState.RUNNING
        session.commit()
    response = client.post(f"/v1/jobs/{job_id}/checkpoint")
    assert response.status_code == 409, response.text
    assert "saves its checkpoints itself" in response.text
