"""`elastrain serve`: the API and the scheduler in this process (the service and FastAPI
are imported only when it runs), and `--demo`'s job once the API answers."""

from __future__ import annotations

import ipaddress
import time
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
import yaml

from elastrain.api.cli.output import fail

if TYPE_CHECKING:
    from elastrain.service.settings import Settings


def serve(
    host: Annotated[str | None, typer.Option(help="Default: ELASTRAIN_HOST or 127.0.0.1.")] = None,
    port: Annotated[int | None, typer.Option(help="Default: ELASTRAIN_PORT or 8000.")] = None,
    no_scheduler: Annotated[
        bool, typer.Option("--no-scheduler", help="API only; another process schedules.")
    ] = False,
    demo: Annotated[
        bool, typer.Option("--demo", help="Once up, submit a small real GPT job to watch.")
    ] = False,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Serve off loopback WITHOUT authentication: anyone who reaches the port "
            "can run code on the cluster. Only behind something that authenticates.",
        ),
    ] = False,
    api_workers: Annotated[
        int,
        typer.Option(
            "--api-workers",
            min=1,
            max=64,
            help="API processes on the one port (uvicorn workers); the scheduler still runs "
            "once, in this process.",
        ),
    ] = 1,
) -> None:
    """Run the API (and the scheduler); applies database migrations first."""
    import logging

    import uvicorn
    from pydantic import ValidationError

    from elastrain.api.main import create_app
    from elastrain.service.logs import configure_logging
    from elastrain.service.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        fail(f"configuration: {'; '.join(str(e['msg']) for e in exc.errors())}", code=2)
    configure_logging(settings.log_format)
    host = host or settings.host
    port = port or settings.port
    if not settings.auth_enabled and not is_loopback(host):
        if not insecure:
            fail(
                f"refusing to serve on {host} without authentication: anyone who reaches "
                "the port could run code on the cluster. Set ELASTRAIN_API_TOKEN (see README "
                "'Security'), bind 127.0.0.1, or pass --insecure if something in front "
                "authenticates.",
                code=2,
            )
        logging.getLogger("elastrain").warning(
            "INSECURE: serving on %s:%s WITHOUT authentication (--insecure); anyone who "
            "reaches this port can run code on the cluster",
            host,
            port,
        )
    if settings.auth_enabled and settings.single_user:
        # Tokens on a local Ray: every tenant's code would run as this user, beside the
        # database and every job's files (README "Security").
        logging.getLogger("elastrain").warning(
            "single-host mode is single-user: jobs run as this user on a local Ray, so a "
            "tenant (non-admin) token's code can read the database and other tenants' "
            "files. For tenants, set ELASTRAIN_RAY_ADDRESS to a Ray cluster whose workers "
            "run as another user"
        )
    if demo:
        _submit_demo_when_up(f"http://{host}:{port}")
    # log_config None: our handlers (text or JSON), not uvicorn's. The protocol bounds
    # what one client may hold: header size and time, connections (api/http_guard.py).
    served: dict[str, Any] = {"host": host, "port": port, "log_level": "info",
                              "access_log": False, "log_config": None,
                              **guarded_http(settings)}  # fmt: skip
    if api_workers == 1:
        uvicorn.run(create_app(settings, start_scheduler=not no_scheduler), **served)
        return
    _serve_api_workers(settings, api_workers, schedule=not no_scheduler, served=served)


def _serve_api_workers(
    settings: Settings, workers: int, *, schedule: bool, served: dict[str, Any]
) -> None:
    """`workers` API processes (uvicorn's supervisor forks them; each builds the app from
    the same environment) and, in this process, the one scheduler. Migrations run here
    first, so the workers find the schema ready."""
    import uvicorn

    from elastrain.service.db import make_engine, make_session_factory, migrate
    from elastrain.service.scheduler import start_scheduler_thread

    settings.ensure_dirs()
    engine = make_engine(settings.database_url)
    migrate(engine)
    scheduler = start_scheduler_thread(settings, make_session_factory(engine)) if schedule else None
    try:
        uvicorn.run("elastrain.api.main:create_app", factory=True, workers=workers, **served)
    finally:
        if scheduler is not None:
            scheduler.stop()
        engine.dispose()


def guarded_http(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for a server that survives slow and large clients."""
    from elastrain.api.http_guard import GuardedHttpProtocol

    return {
        "http": GuardedHttpProtocol,
        "timeout_keep_alive": settings.keep_alive_s,
        # The guard's connection limit replaces uvicorn's, which answers 503 to everyone
        # once idle sockets fill it; backlog: room for a burst of new connections.
        "limit_concurrency": None,
        "backlog": 4096,
    }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _submit_demo_when_up(url: str) -> None:
    """Submit the packaged demo spec over REST as soon as the API answers (a thread, so
    the job goes through exactly the path a user's submit takes)."""
    import threading
    from importlib.resources import files

    spec = yaml.safe_load(files("elastrain.api").joinpath("demo/gpt-tiny.yaml").read_text())

    def submit_when_up() -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(600):
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            job = client.post("/v1/jobs", json=spec).json()
        typer.echo(
            f"\ndemo job {job['id']} ({job['name']}) submitted: watch it at {url}/#/jobs/{job['id']}"
            f"\n  or: elastrain status {job['id']} / elastrain logs {job['id']} -f\n"
        )

    threading.Thread(target=submit_when_up, name="demo-submit", daemon=True).start()
