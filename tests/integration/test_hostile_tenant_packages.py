"""Hostile tenants and packages (issue 26, item 5), on SQLite and PostgreSQL.

A package is its uploader's: another tenant cannot look it up, run it, or learn that it
exists; an admin shares it. Uploads count against a per-tenant storage quota, and what a zip
inflates to is bounded (absolute size, expansion ratio, quota) while it is unpacked.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from elastrain.api.main import create_app
from elastrain.service.settings import Settings
from tests.factories import a_zip, spec_dict

ADMIN = "operator-admin-token-0123456789"
ZIP = {"Content-Type": "application/zip"}
CODE = {"secret_model.py": "def build(): ...\n", "helpers.py": "KEY = 'tenant a only'\n"}


@dataclass
class Tenants:
    client: TestClient
    settings: Settings
    headers: dict[str, dict[str, str]]

    def upload(self, who: str, body: bytes) -> Any:
        return self.client.post("/v1/packages", content=body, headers={**ZIP, **self.headers[who]})

    def submit(self, who: str, digest: str) -> Any:
        spec = spec_dict(
            name="pkg", workload={"entrypoint": "secret_model:build", "package": digest}
        )
        return self.client.post("/v1/jobs", json=spec, headers=self.headers[who])


def _tenants(settings: Settings) -> Iterator[Tenants]:
    secured = settings.model_copy(update={"api_token": SecretStr(ADMIN)})
    with TestClient(create_app(secured)) as client:
        headers = {"admin": {"Authorization": f"Bearer {ADMIN}"}}
        for name in ("team-a", "team-b"):
            made = client.post("/v1/tokens", json={"tenant": name}, headers=headers["admin"])
            headers[name] = {"Authorization": f"Bearer {made.json()['token']}"}
        yield Tenants(client, secured, headers)


@pytest.fixture
def tenants(settings: Settings) -> Iterator[Tenants]:
    yield from _tenants(settings)


@pytest.fixture
def tight(settings: Settings) -> Iterator[Tenants]:
    """A 64 KiB storage quota per tenant."""
    yield from _tenants(settings.model_copy(update={"package_quota_bytes": 64 * 1024}))


def test_another_tenants_package_does_not_exist_for_you(tenants: Tenants) -> None:
    up = tenants.upload("team-a", a_zip(CODE))
    assert up.status_code == 201, up.text
    digest, nobody = up.json()["digest"], "sha256:" + "ab" * 32
    c, b = tenants.client, tenants.headers["team-b"]
    assert tenants.submit("team-a", digest).status_code == 201

    # Looking it up: the very answer a digest nobody uploaded gets (but for the digest).
    theirs, missing = (
        c.get(f"/v1/packages/{digest}", headers=b),
        c.get(f"/v1/packages/{nobody}", headers=b),
    )
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["detail"].replace(digest, "D") == missing.json()["detail"].replace(
        nobody, "D"
    )
    # Running it: 422 naming workload.package, the words used for a digest nobody has.
    run, ghost = tenants.submit("team-b", digest), tenants.submit("team-b", nobody)
    assert run.status_code == ghost.status_code == 422
    assert run.json()["message"].startswith("workload.package:")
    assert run.json()["message"].replace(digest, "D") == ghost.json()["message"].replace(
        nobody, "D"
    )
    assert "secret_model" not in run.text and "helpers" not in run.text

    # Uploading the same content is a first upload for team-b (201, not "already there").
    again = tenants.upload("team-b", a_zip(CODE))
    assert again.status_code == 201 and again.json()["digest"] == digest
    assert tenants.submit("team-b", digest).status_code == 201
    assert tenants.upload("team-b", a_zip(CODE)).status_code == 200  # its own, now
    # Admins see who holds it: both uploads attributed.
    seen = c.get(f"/v1/packages/{digest}", headers=tenants.headers["admin"]).json()
    assert [(g["tenant"], g["uploaded"], g["granted_by"]) for g in seen["grants"]] == [
        ("team-a", True, "team-a"),
        ("team-b", True, "team-b"),
    ]
    assert (
        c.get(f"/v1/packages/{digest}", headers=tenants.headers["team-a"]).json()["grants"] is None
    )


def test_an_admin_shares_a_package_and_takes_the_share_back(tenants: Tenants) -> None:
    digest = tenants.upload("team-a", a_zip(CODE)).json()["digest"]
    c, admin = tenants.client, tenants.headers["admin"]
    url = f"/v1/packages/{digest}/share"
    assert (
        c.post(url, json={"tenant": "team-b"}, headers=tenants.headers["team-a"]).status_code == 403
    )
    assert c.post(url, json={"tenant": "bad name"}, headers=admin).status_code == 422
    shared = c.post(url, json={"tenant": "team-b"}, headers=admin)
    assert shared.status_code == 200
    assert ("team-b", False, "default") in [
        (g["tenant"], g["uploaded"], g["granted_by"]) for g in shared.json()["grants"]
    ]
    assert tenants.submit("team-b", digest).status_code == 201
    assert c.delete(f"{url}/team-b", headers=admin).status_code == 204
    assert tenants.submit("team-b", digest).status_code == 422
    # Withdrawing a "share" of the uploader does not take its own upload away.
    assert c.delete(f"{url}/team-a", headers=admin).status_code == 204
    assert tenants.submit("team-a", digest).status_code == 201
    # '*': every tenant, present and future.
    assert c.post(url, json={"tenant": "*"}, headers=admin).status_code == 200
    assert c.get(f"/v1/packages/{digest}", headers=tenants.headers["team-b"]).status_code == 200
    assert c.delete(f"{url}/*", headers=admin).status_code == 204
    assert c.get(f"/v1/packages/{digest}", headers=tenants.headers["team-b"]).status_code == 404
    nothing = c.post(
        f"/v1/packages/sha256:{'cd' * 32}/share", json={"tenant": "team-b"}, headers=admin
    )
    assert nothing.status_code == 404


def test_uploads_count_against_the_tenants_storage_quota(tight: Tenants) -> None:
    def random_files(seed: int, kib: int) -> dict[str, bytes | str]:
        import random

        rng = random.Random(seed)
        return {"secret_model.py": "def build(): ...\n", "blob.bin": rng.randbytes(kib * 1024)}

    assert tight.upload("team-a", a_zip(random_files(1, 20))).status_code == 201
    # Re-uploading what it has costs nothing more (while there is room to check it).
    assert tight.upload("team-a", a_zip(random_files(1, 20))).status_code == 200
    assert tight.upload("team-a", a_zip(random_files(2, 40))).status_code == 201  # 60 KiB
    over = tight.upload("team-a", a_zip(random_files(3, 20)))  # 80 KiB > 64 KiB
    assert over.status_code == 413, over.text
    assert "ELASTRAIN_PACKAGE_QUOTA_BYTES" in over.json()["detail"]
    stored = tight.settings.storage_path / "packages"
    assert len([p for p in stored.iterdir() if not p.name.startswith(".")]) == 2  # none kept
    # Another tenant's quota is its own.
    assert tight.upload("team-b", a_zip(random_files(3, 20))).status_code == 201
    full = tight.upload("team-a", a_zip(random_files(4, 5)))  # 65 KiB
    assert full.status_code == 413


def test_a_zip_bomb_stops_at_the_expansion_limit_while_unpacking(
    tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ~50 KB of zip that inflates to 50 MB: within the 256 MiB absolute limit, far past
    # 100x its size. The bytes inflated are counted where zipfile hands them out.
    bomb = a_zip({"secret_model.py": "", "zeros.bin": b"\0" * (50 * 2**20)}, level=9)
    inflated = 0
    real_read = zipfile.ZipExtFile.read

    def counting_read(self: zipfile.ZipExtFile, n: int = -1) -> bytes:
        nonlocal inflated
        data = real_read(self, n)
        inflated += len(data)
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting_read)
    refused = tenants.upload("team-a", bomb)
    assert refused.status_code == 422, refused.text
    assert "ELASTRAIN_MAX_PACKAGE_EXPANSION" in refused.json()["detail"]
    budget = max(100 * len(bomb), 2**20)
    assert inflated <= budget + 2**20  # stopped within one chunk of the limit
    assert inflated < 50 * 2**20 / 4
    stored = tenants.settings.storage_path / "packages"
    assert [p.name for p in stored.iterdir()] == []  # staging removed, nothing stored


def test_uploads_are_attributed(tenants: Tenants, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="elastrain.api"):
        digest = tenants.upload("team-b", a_zip(CODE)).json()["digest"]
    assert any(
        f"package {digest} uploaded by tenant team-b" in r.getMessage() for r in caplog.records
    )
