"""The environment a job's workers start with: the service's, less its secrets."""

from __future__ import annotations

import os

import pytest

from elastrain.service.worker_env import scrubbed_environ, worker_env

SERVICE = {
    "PATH": "/usr/bin",
    "HOME": "/home/svc",
    "ELASTRAIN_API_TOKEN": "tok-0123456789abcdef",
    "ELASTRAIN_DATABASE_URL": "postgresql://svc:hunter2@db/elastrain",
    "ELASTRAIN_ALLOWED_ENTRYPOINTS": "my_pkg",
    "ELASTRAIN_PEAK_FLOPS": "1e12",
    "ELASTRAIN_PACKAGE_CACHE": "/var/cache/pk",
    "PGPASSWORD": "hunter2",
    "DATABASE_URL": "postgresql://svc:hunter2@db/elastrain",
    "CI_SECRET": "prefix tok-0123456789abcdef suffix",
    "CUDA_VISIBLE_DEVICES": "0",
}
SECRETS = ["tok-0123456789abcdef", "postgresql://svc:hunter2@db/elastrain", "hunter2"]


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("PATH", True),
        ("HOME", True),
        ("CUDA_VISIBLE_DEVICES", True),
        ("ELASTRAIN_PEAK_FLOPS", True),  # read by the workers themselves
        ("ELASTRAIN_PACKAGE_CACHE", True),
        ("ELASTRAIN_API_TOKEN", False),
        ("ELASTRAIN_DATABASE_URL", False),
        ("ELASTRAIN_ALLOWED_ENTRYPOINTS", False),  # the service's configuration
        ("PGPASSWORD", False),
        ("DATABASE_URL", False),  # by its value, whatever its name
        ("CI_SECRET", False),
    ],
)
def test_worker_env(name: str, kept: bool) -> None:
    assert (name in worker_env(SERVICE, SECRETS)) is kept


def test_scrubbed_environ_is_whole_again_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_API_TOKEN", "tok-0123456789abcdef")
    monkeypatch.setenv("SOME_URL", "x tok-0123456789abcdef")
    before = dict(os.environ)
    with scrubbed_environ(["tok-0123456789abcdef"]):
        assert "ELASTRAIN_API_TOKEN" not in os.environ and "SOME_URL" not in os.environ
        assert os.environ.get("PATH") == before.get("PATH")
    assert dict(os.environ) == before
