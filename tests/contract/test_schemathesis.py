"""Property-based tests over the OpenAPI spec (schemathesis): whatever a client sends to
any route, with or without a token, the answer is never a 5xx.

Schemathesis generates requests from each route's schema (valid ones, and ones that break
it: wrong types, out-of-range numbers, odd strings) and sends them through the ASGI app.
Driven through Hypothesis directly (its pytest plugin does not load on pytest 9); one test
per route and auth mode, the routes read from the app so that a new one is covered at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from elastrain.api.main import create_app
from elastrain.service.settings import Settings
from tests.factories import spec_dict

ADMIN_TOKEN = "schemathesis-admin-token-0123456789"


@schemathesis.serializer("application/zip")
def _zip_body(ctx: Any, value: Any) -> bytes:
    """Uploads are raw bytes (`format: binary`): whatever was generated goes as the body,
    so the service sees garbage archives, not only well-formed ones."""
    return value if isinstance(value, bytes) else str(value).encode()


ROUTES = sorted(
    (method, path)
    for path, item in create_app(Settings(database_url="sqlite://")).openapi()["paths"].items()
    for method in item
)


@dataclass
class Target:
    schema: Any
    headers: dict[str, str]
    known: dict[str, Any]  # path parameters that exist: a job, a token, a tenant


@pytest.fixture(scope="module", params=["auth-off", "auth-on"])
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("fuzz")
    token = SecretStr(ADMIN_TOKEN) if request.param == "auth-on" else None
    app = create_app(
        Settings(
            database_url=f"sqlite:///{root / 'db.sqlite'}",
            storage_path=root / "storage",
            api_token=token,
        )
    )
    with TestClient(app) as client:  # runs the lifespan: migrations, sessions
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if token else {}
        # Something for the routes about one job or one token to find.
        job = client.post("/v1/jobs", json=spec_dict(), headers=headers)
        token = client.post("/v1/tokens", json={"tenant": "t1"}, headers=headers)
        assert job.status_code == token.status_code == 201
        known = {"job_id": job.json()["id"], "token_id": token.json()["id"], "name": "t1"}
        yield Target(schemathesis.openapi.from_asgi("/openapi.json", app), headers, known)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_no_request_gets_a_server_error(target: Target, method: str, path: str) -> None:
    operation = target.schema[path][method.upper()]

    # Valid requests about things that exist (so the routes' own logic runs, not only
    # their 404), valid requests about anything, and requests that break the schema.
    existing = {k: v for k, v in target.known.items() if "{" + k + "}" in path}
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE, path_parameters=existing or None),
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=cases)
    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run: a failure here is reproducible
        database=None,
    )
    def fuzz(case: Any) -> None:
        case.call_and_validate(headers=target.headers, checks=[not_a_server_error])

    fuzz()
