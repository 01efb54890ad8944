"""The environment a job's processes start with: the service's, less its secrets.

Ray's worker processes inherit the environment of the raylet that starts them, and a local
Ray's raylet inherits the environment of the process that starts it: the service, which
holds the admin token and the database URL. Tenant code runs in those workers, so the local
Ray is started with `worker_env` instead (`scrubbed_environ`). On an external cluster the
raylets' environment is the operator's (`ray start`, KubeRay), and nothing of the service's
reaches its workers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

#: `ELASTRAIN_*` variables the workers themselves read (node settings, no secrets).
WORKER_VARIABLES = frozenset(
    {"ELASTRAIN_PEAK_FLOPS", "ELASTRAIN_PACKAGE_CACHE", "ELASTRAIN_PROFILE_STEPS"}
)
#: libpq reads these (a password, a password file, a service file): never for workers.
_LIBPQ_PREFIX = "PG"

_swap_lock = threading.Lock()


def worker_env(environ: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """`environ` without the service's configuration and secrets: no `ELASTRAIN_*` but
    the workers' own, no libpq `PG*` variable, and no variable whose value holds one of
    `secrets` (the admin token, the database URL or its password, whatever the name)."""
    needles = [s for s in secrets if s]
    return {
        name: value
        for name, value in environ.items()
        if not (name.startswith("ELASTRAIN_") and name not in WORKER_VARIABLES)
        and not name.startswith(_LIBPQ_PREFIX)
        and not any(needle in value for needle in needles)
    }


@contextmanager
def scrubbed_environ(secrets: Iterable[str] = ()) -> Iterator[None]:
    """`os.environ` is `worker_env` of itself while inside (processes started then, a
    local Ray's, inherit that), and whole again after."""
    with _swap_lock:
        saved = dict(os.environ)
        clean = worker_env(saved, secrets)
        for name in set(saved) - set(clean):
            del os.environ[name]
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
