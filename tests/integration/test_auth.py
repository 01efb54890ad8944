"""Tenants and tokens, on SQLite and PostgreSQL: who may do what, route by route.

The permission matrix walks every route of the OpenAPI spec, so a route added without a
line in `ACCESS` fails here until someone decides who may call it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from elastrain.api.main import create_app
from elastrain.service import cluster, drains
from elastrain.service.db import session_scope
from elastrain.service.models import ApiToken
from elastrain.service.settings import Settings
from tests.factories import a_zip, spec_dict

ADMIN_TOKEN = "operator-admin-token-0123456789"

# Who may call a route: "open" (no token), "tenant" (any token; sees its own), "job" (a
# job's or package's tenant or an admin; others get 404), "token" (a token's tenant or an admin), "admin".
ACCESS: dict[tuple[str, str], str] = {
    ("get", "/healthz"): "open",
    ("get", "/metrics"): "admin",
    ("get", "/v1/me"): "tenant",
    ("get", "/v1/cluster"): "tenant",
    ("get", "/v1/jobs"): "tenant",
    ("post", "/v1/jobs"): "tenant",
    ("get", "/v1/jobs/{job_id}"): "job",
    ("post", "/v1/jobs/{job_id}/cancel"): "job",
    ("post", "/v1/jobs/{job_id}/checkpoint"): "job",
    ("get", "/v1/jobs/{job_id}/events"): "job",
    ("get", "/v1/jobs/{job_id}/metrics"): "job",
    ("get", "/v1/jobs/{job_id}/checkpoints"): "job",
    ("get", "/v1/jobs/{job_id}/logs"): "job",
    ("get", "/v1/jobs/{job_id}/export"): "job",
    ("get", "/v1/tokens"): "tenant",
    ("post", "/v1/tokens"): "admin",
    ("delete", "/v1/tokens/{token_id}"): "token",
    ("get", "/v1/tenants"): "admin",
    ("put", "/v1/tenants/{name}"): "admin",
    ("post", "/v1/packages"): "tenant",
    ("get", "/v1/packages/{digest}"): "job",  # the uploader's (or shared); others: 404
    ("post", "/v1/packages/{digest}/share"): "admin",
    ("delete", "/v1/packages/{digest}/share/{name}"): "admin",
    ("post", "/v1/plan"): "tenant",
    ("post", "/v1/cluster/nodes/{node_id}/drain"): "admin",
    ("post", "/v1/cluster/nodes/{node_id}/undrain"): "admin",
    ("delete", "/v1/cluster/nodes/{node_id}/drain"): "admin",
}
#: The one node of the cluster snapshot the world publishes (drain routes name it).
NODE = "ab" * 28
ZIP = {"Content-Type": "application/zip"}


@dataclass
class World:
    client: TestClient
    sessions: sessionmaker[Session]
    tokens: dict[str, str]  # who -> bearer token
    jobs: dict[str, int]  # tenant -> one of its jobs
    package: str = ""  # the digest of a stored package

    def as_(self, who: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def new_token(self, tenant: str) -> dict[str, Any]:
        body = {"tenant": tenant, "name": "throwaway"}
        made: dict[str, Any] = self.client.post(
            "/v1/tokens", json=body, headers=self.as_("admin")
        ).json()
        return made


@pytest.fixture
def world(settings: Settings) -> Iterator[World]:
    secured = settings.model_copy(update={"api_token": SecretStr(ADMIN_TOKEN)})
    with TestClient(create_app(secured)) as client:
        w = World(
            client=client,
            sessions=client.app.state.session_factory,  # type: ignore[attr-defined]
            tokens={"admin": ADMIN_TOKEN},
            jobs={},
        )
        for tenant in ("team-a", "team-b"):
            made = w.new_token(tenant)
            assert made["token"].startswith("elt_") and made["tenant"] == tenant
            w.tokens[tenant] = made["token"]
            job = client.post("/v1/jobs", json=spec_dict(name=tenant), headers=w.as_(tenant))
            assert job.status_code == 201 and job.json()["owner"] == tenant
            w.jobs[tenant] = job.json()["id"]
        upload = client.post(
            "/v1/packages",
            content=a_zip({"matrix_model.py": "def build(): ...\n"}),
            headers={**ZIP, **w.as_("team-a")},
        )
        assert upload.status_code == 201, upload.text
        w.package = upload.json()["digest"]
        node = cluster.NodeView(
            node_id=NODE, address="10.0.0.9", alive=True, cpus_total=1, cpus_free=1,
            gpus_total=0, gpus_free=0,
        )  # fmt: skip
        with session_scope(w.sessions) as s:
            cluster.publish(s, cluster.ClusterView(connected=True, nodes=[node]))
        yield w


def _request(w: World, method: str, path: str, owner: str) -> tuple[str, str, Any]:
    """A well-formed call of the route, about `owner`'s things."""
    url = path.replace("{job_id}", str(w.jobs[owner])).replace("{name}", owner)
    url = url.replace("{digest}", w.package).replace("{node_id}", NODE)
    if url.endswith("/undrain") or (method == "delete" and url.endswith("/drain")):
        with session_scope(w.sessions) as s:  # something to undrain
            drains.drain(s, node_id=NODE, reason="matrix", deadline=None, by="admin")
    if "{token_id}" in url:
        url = url.replace("{token_id}", str(w.new_token(owner)["id"]))
    body = {
        ("post", "/v1/jobs"): spec_dict(name="matrix"),
        ("post", "/v1/tokens"): {"tenant": owner},
        ("put", "/v1/tenants/{name}"): {"max_workers": 4},
        ("post", "/v1/packages"): a_zip({"matrix_model.py": "def build(): ...\n"}),
        ("post", "/v1/packages/{digest}/share"): {"tenant": owner},
        ("post", "/v1/plan"): {"spec": spec_dict(), "device_memory_bytes": 2**30},
    }.get((method, path))
    return method, url, body


def _call(w: World, who: str | None, req: tuple[str, str, Any]) -> int:
    method, url, body = req
    if isinstance(body, bytes):  # an upload
        headers = {**ZIP, **w.as_(who)}
        return w.client.request(method.upper(), url, content=body, headers=headers).status_code
    return w.client.request(method.upper(), url, json=body, headers=w.as_(who)).status_code


def allowed(status: int) -> bool:
    """Past authorisation: the route itself answered (a 409 says the job's state forbids
    it, a 422 that the job's workload has no export format, which only someone allowed to
    see the job may learn)."""
    return status < 300 or status in (409, 422)


def test_permission_matrix_over_every_route(world: World) -> None:
    routes = {
        (method, path)
        for path, item in world.client.get("/openapi.json").json()["paths"].items()
        for method in item
    }
    assert routes == set(ACCESS), "a route without a line in ACCESS: decide who may call it"
    for (method, path), rule in sorted(ACCESS.items()):
        where = f"{method.upper()} {path}"
        req = _request(world, method, path, "team-a")
        if rule == "open":
            assert _call(world, None, req) == 200, where
            continue
        assert _call(world, None, req) == 401, where
        assert _call(world, "team-a", (method, req[1], req[2])) != 401, where
        bad = {"Authorization": "Bearer elt_not-a-token-at-all-0000000000000000"}
        assert world.client.request(method.upper(), req[1], headers=bad).status_code == 401
        if rule == "admin":
            assert _call(world, "team-a", req) == 403, where
            assert allowed(_call(world, "admin", req)), where
        elif rule in ("job", "token"):
            assert _call(world, "team-b", req) == 404, where  # another tenant's: absent
            assert allowed(_call(world, "team-a", _request(world, method, path, "team-a"))), where
            assert allowed(_call(world, "admin", _request(world, method, path, "team-a"))), where
        else:
            assert allowed(_call(world, "team-b", req)), where
            assert allowed(_call(world, "admin", req)), where


def test_another_tenants_jobs_are_absent_everywhere(world: World) -> None:
    c, a_job = world.client, world.jobs["team-a"]
    b = world.as_("team-b")
    listing = c.get("/v1/jobs", headers=b).json()
    assert [j["id"] for j in listing["items"]] == [world.jobs["team-b"]]
    assert listing["total"] == 1
    everything = c.get("/v1/jobs", headers=world.as_("admin")).json()
    assert {j["id"] for j in everything["items"]} == set(world.jobs.values())
    for suffix in ("", "/events", "/metrics", "/checkpoints", "/logs"):
        response = c.get(f"/v1/jobs/{a_job}{suffix}", headers=b)
        assert response.status_code == 404
        assert response.json() == {"detail": f"job {a_job} not found"}  # as if it never was
    assert c.post(f"/v1/jobs/{a_job}/cancel", headers=b).status_code == 404
    mine = c.get(f"/v1/jobs/{a_job}", headers=world.as_("team-a")).json()
    assert mine["state"] == "PENDING" and not mine["cancel_requested"]


def test_the_cluster_view_names_only_the_callers_jobs(world: World) -> None:
    a, b = world.jobs["team-a"], world.jobs["team-b"]
    node = cluster.NodeView(
        node_id="n1", address="10.0.0.1", alive=True, cpus_total=4, cpus_free=0,
        gpus_total=0, gpus_free=0, jobs=[a, b],
    )  # fmt: skip
    with session_scope(world.sessions) as s:
        cluster.publish(s, cluster.ClusterView(connected=True, nodes=[node]))

    def jobs_seen(who: str) -> list[int]:
        view = world.client.get("/v1/cluster", headers=world.as_(who)).json()
        return list(view["nodes"][0]["jobs"])

    assert jobs_seen("team-b") == [b]
    assert jobs_seen("team-a") == [a]
    assert jobs_seen("admin") == [a, b]


def test_tokens_are_stored_hashed_listed_per_tenant_and_revocable(world: World) -> None:
    c = world.client
    made = world.new_token("team-a")
    with session_scope(world.sessions) as s:
        stored = s.scalars(select(ApiToken).where(ApiToken.id == made["id"])).one()
        assert made["token"] not in (stored.sha256, stored.prefix, stored.name)
        dump = "\n".join(str(row) for row in s.execute(text("SELECT * FROM api_tokens")))
        assert made["token"] not in dump
    own = c.get("/v1/tokens", headers=world.as_("team-a")).json()
    assert {t["tenant"] for t in own} == {"team-a"} and all("token" not in t for t in own)
    assert {t["tenant"] for t in c.get("/v1/tokens", headers=world.as_("admin")).json()} == {
        "team-a",
        "team-b",
    }
    fresh = {"Authorization": f"Bearer {made['token']}"}
    assert c.get("/v1/me", headers=fresh).json() == {
        "tenant": "team-a",
        "admin": False,
        "auth": True,
    }
    # A tenant revokes its own leaked token; from then on it is refused.
    revoked = c.delete(f"/v1/tokens/{made['id']}", headers=world.as_("team-a"))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert c.get("/v1/me", headers=fresh).status_code == 401
    again = c.delete(f"/v1/tokens/{made['id']}", headers=world.as_("team-a"))
    assert again.status_code == 200  # idempotent


def test_admin_tokens_from_the_api_see_everything(world: World) -> None:
    made = world.client.post(
        "/v1/tokens", json={"tenant": "ops", "admin": True}, headers=world.as_("admin")
    ).json()
    ops = {"Authorization": f"Bearer {made['token']}"}
    assert world.client.get("/v1/jobs", headers=ops).json()["total"] == 2
    job = world.client.post("/v1/jobs", json=spec_dict(name="ops-job"), headers=ops).json()
    assert job["owner"] == "ops"  # an admin's own jobs are its tenant's


def test_quotas_are_set_and_listed_by_admins(world: World) -> None:
    c = world.client
    put = c.put("/v1/tenants/team-a", json={"max_workers": 3}, headers=world.as_("admin"))
    assert put.json() == {"name": "team-a", "max_workers": 3, "quota": 3, "workers_in_use": 0}
    tenants = {t["name"]: t for t in c.get("/v1/tenants", headers=world.as_("admin")).json()}
    assert tenants["team-b"]["quota"] is None
    bad = c.put("/v1/tenants/team-a", json={"max_workers": 0}, headers=world.as_("admin"))
    assert bad.status_code == 422 and "max_workers" in bad.json()["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tenant": "bad name"}, "tenant"),
        ({"tenant": "-leading-dash"}, "tenant"),
        ({"tenant": "x" * 64}, "tenant"),
        ({"tenant": "a", "name": "bell\x07"}, "name"),
        ({"tenant": "a", "role": "root"}, "role"),
    ],
)
def test_bad_token_requests_are_422(world: World, body: dict[str, Any], field: str) -> None:
    response = world.client.post("/v1/tokens", json=body, headers=world.as_("admin"))
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith(f"{field}:")


def test_openapi_declares_the_bearer_scheme(world: World) -> None:
    spec = world.client.get("/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert [(s["type"], s["scheme"]) for s in schemes.values()] == [("http", "bearer")]
    assert spec["paths"]["/v1/jobs"]["get"]["security"]


@pytest.mark.parametrize("value", ["", "   ", "short"])
def test_an_empty_or_short_token_is_a_configuration_error(value: str) -> None:
    with pytest.raises(ValueError, match="at least 16 characters"):
        Settings(api_token=value)


def test_without_auth_one_user_owns_everything(client: TestClient) -> None:
    assert client.get("/v1/me").json() == {"tenant": "default", "admin": True, "auth": False}
    job = client.post("/v1/jobs", json=spec_dict()).json()
    assert job["owner"] == "default"


def test_auth_from_database_tokens_only(settings: Settings) -> None:
    """ELASTRAIN_AUTH=true without an operator token: the first admin token is written
    into the database by `elastrain token create --database-url`."""
    from typer.testing import CliRunner

    from elastrain.api.cli import app as cli

    result = CliRunner().invoke(
        cli,
        ["token", "create", "--tenant", "ops", "--admin", "--database-url", settings.database_url],
    )
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    with TestClient(create_app(settings.model_copy(update={"auth": True}))) as c:
        assert c.get("/v1/jobs").status_code == 401
        me = c.get("/v1/me", headers={"Authorization": f"Bearer {token}"}).json()
        assert me == {"tenant": "ops", "admin": True, "auth": True}
