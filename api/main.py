"""The FastAPI application factory.

`uvicorn elastrain.api.main:create_app --factory` or `elastrain serve`. Importing this module is
cheap and touches no database: the lifespan builds the engine, migrates, and (optionally)
starts the scheduler thread.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from elastrain.api import errors
from elastrain.api.deps import TokenCache
from elastrain.api.routes import api_docs, cluster, health, jobs, metrics, packages, plan, tenants
from elastrain.api.security import RequestGuard
from elastrain.service.db import make_engine, make_session_factory, migrate
from elastrain.service.settings import Settings

log = logging.getLogger("elastrain.api")

#: Request bodies larger than this are refused as they stream in (a spec is a few KiB).
MAX_BODY_BYTES = 1 << 20


def _start_scheduler(app: FastAPI, settings: Settings) -> Any:
    # Imported here, not at the top: the scheduler reaches Ray through the launcher, and
    # `import elastrain.api.main` must stay free of Ray (tests/unit/test_imports.py).
    from elastrain.service.scheduler import start_scheduler_thread

    return start_scheduler_thread(settings, app.state.session_factory)


def _include_dashboard(app: FastAPI) -> None:
    # The dashboard ships in its own module; the API works without it.
    if importlib.util.find_spec("elastrain.api.routes.dashboard") is None:
        return
    module = importlib.import_module("elastrain.api.routes.dashboard")
    app.include_router(module.router)


def create_app(settings: Settings | None = None, *, start_scheduler: bool = False) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.ensure_dirs()
        engine = make_engine(settings.database_url)
        migrate(engine)
        app.state.engine = engine
        app.state.session_factory = make_session_factory(engine)
        app.state.scheduler = _start_scheduler(app, settings) if start_scheduler else None
        # Everything loaded so far (modules, routes, schemas, the engine) lives as long as
        # the process: out of the collector's sight, a full collection no longer walks it,
        # which took tens of milliseconds out of the requests that happened to trigger one.
        gc.freeze()
        try:
            yield
        finally:
            if app.state.scheduler is not None:
                app.state.scheduler.stop()
            engine.dispose()

    app = FastAPI(
        title="elastrain",
        summary="Elastic PyTorch training on Ray: submit, watch and steer training jobs.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # ours, from local files (api/routes/api_docs.py)
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.scheduler = None
    errors.install(app)
    app.include_router(health.router)
    app.include_router(api_docs.router)
    app.include_router(jobs.router)
    app.include_router(cluster.router)
    app.include_router(tenants.router)
    app.include_router(metrics.router)
    app.include_router(packages.router)
    app.include_router(plan.router)
    _include_dashboard(app)
    app.state.token_cache = TokenCache()
    app.add_middleware(
        RequestGuard,
        allowed_hosts=settings.allowed_hosts,
        max_body_bytes=MAX_BODY_BYTES,
        body_limits={"/v1/packages": settings.max_package_bytes},
    )
    return app
