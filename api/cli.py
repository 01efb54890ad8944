"""`elastrain`: the command line. Everything but `serve` talks to the REST API over HTTP.

Kept light: importing it loads neither the service nor FastAPI; `serve` imports them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml

app = typer.Typer(
    name="elastrain",
    help="Elastic PyTorch training on Ray: submit, watch and steer jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
DEFAULT_URL = "http://127.0.0.1:8000"


class Api:
    """A thin HTTP client that turns every failure into a message and an exit code."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            fail(f"cannot reach the elastrain API at {self.url} ({exc})", code=2)
        if response.is_error:
            fail(f"error {response.status_code}: {_error_message(response)}")
        return response.json()


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail
        if isinstance(detail, list):
            return "; ".join(str(d.get("msg", d)) for d in detail if isinstance(d, dict))
    return json.dumps(body)


def fail(message: str, *, code: int = 1) -> NoReturn:
    typer.echo(f"elastrain: {message}", err=True)
    raise typer.Exit(code)


def api(ctx: typer.Context) -> Api:
    client: Api = ctx.obj
    return client


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option(envvar="ELASTRAIN_URL", help="The elastrain API.")
    ] = DEFAULT_URL,
    token: Annotated[
        str | None,
        typer.Option(envvar="ELASTRAIN_TOKEN", help="API token (when the server needs one)."),
    ] = None,
) -> None:
    ctx.obj = Api(url, token)


# --- output ---------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "-"
    text = str(value)
    # ISO timestamps: seconds are plenty in a table.
    if len(text) >= 19 and text[4] == "-" and text[10] == "T":
        return text[:19].replace("T", " ")
    return text


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in cells)]) for i, col in enumerate(columns)]
    header = [col.upper() for col in columns]
    for line in [header, *cells]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _load_spec(path: Path) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    try:
        spec = yaml.safe_load(text)  # YAML is a superset of JSON: both work
    except yaml.YAMLError as exc:
        fail(f"{path} is neither YAML nor JSON: {exc}")
    if not isinstance(spec, dict):
        fail(f"{path}: a job spec must be a mapping (name, workload, ...)")
    return spec


# --- commands -------------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Default: ELASTRAIN_HOST or 127.0.0.1.")] = None,
    port: Annotated[int | None, typer.Option(help="Default: ELASTRAIN_PORT or 8000.")] = None,
    no_scheduler: Annotated[
        bool, typer.Option("--no-scheduler", help="API only; another process schedules.")
    ] = False,
    demo: Annotated[
        bool, typer.Option("--demo", help="Once up, submit a small real GPT job to watch.")
    ] = False,
) -> None:
    """Run the API (and the scheduler); applies database migrations first."""
    import uvicorn

    from api.main import create_app
    from service.settings import Settings

    settings = Settings()
    host = host or settings.host
    port = port or settings.port
    if demo:
        _submit_demo_when_up(f"http://{host}:{port}")
    uvicorn.run(
        create_app(settings, start_scheduler=not no_scheduler),
        host=host,
        port=port,
        log_level="info",
        access_log=False,
    )


def _submit_demo_when_up(url: str) -> None:
    """Submit the packaged demo spec over REST as soon as the API answers (a thread, so
    the job goes through exactly the path a user's submit takes)."""
    import threading
    from importlib.resources import files

    spec = yaml.safe_load(files("api").joinpath("demo/gpt-tiny.yaml").read_text())

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


@app.command()
def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON ('-' for stdin).")],
) -> None:
    """Submit a job; prints its id and state."""
    job = api(ctx).call("POST", "/v1/jobs", json=_load_spec(file))
    typer.echo(f"{job['id']}\t{job['state']}")


@app.command("list")
def list_(
    ctx: typer.Context,
    state: Annotated[list[str] | None, typer.Option(help="Only these states (repeatable).")] = None,
    label: Annotated[list[str] | None, typer.Option(help="key:value (repeatable).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
    offset: Annotated[int, typer.Option(min=0)] = 0,
) -> None:
    """List jobs, newest first."""
    params = [("state", s) for s in state or []] + [("label", lab) for lab in label or []]
    params += [("limit", str(limit)), ("offset", str(offset))]
    page = api(ctx).call("GET", "/v1/jobs", params=params)
    table(
        page["items"],
        [
            "id",
            "name",
            "state",
            "world_size",
            "step",
            "max_steps",
            "latest_loss",
            "attempt",
            "created_at",
        ],
    )
    if page["total"] > len(page["items"]):
        typer.echo(f"({len(page['items'])} of {page['total']}; use --offset/--limit for more)")


@app.command()
def status(ctx: typer.Context, job_id: int) -> None:
    """Show one job."""
    job = api(ctx).call("GET", f"/v1/jobs/{job_id}")
    for key in [
        "id", "name", "owner", "state", "state_reason", "priority", "attempt", "restarts",
        "world_size", "step", "max_steps", "latest_loss", "labels", "cancel_requested",
        "created_at", "started_at", "finished_at", "last_error",
    ]:  # fmt: skip
        typer.echo(f"{key + ':':<18}{_cell(job.get(key))}")
    spec = job["spec"]
    typer.echo(
        f"{'spec:':<18}{spec['strategy']['kind']}, workers "
        f"{spec['scaling']['min_workers']}..{spec['scaling']['max_workers']}, "
        f"global batch {spec['training']['global_batch_size']}"
    )


@app.command()
def events(ctx: typer.Context, job_id: int) -> None:
    """Every transition and notable event of a job."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/events")
    for row in rows:
        row["transition"] = (
            f"{row['from_state'] or ''}->{row['to_state']}" if row["to_state"] else row["kind"]
        )
        row["world"] = f"{_cell(row['world_size_before'])}->{_cell(row['world_size_after'])}"
    table(rows, ["at", "transition", "world", "attempt", "step", "reason"])


@app.command()
def timeline(ctx: typer.Context, job_id: int) -> None:
    """Where the seconds of each start, recovery and resize went, phase by phase."""
    rows = []
    for event in api(ctx).call("GET", f"/v1/jobs/{job_id}/events"):
        if event["kind"] != "timeline":
            continue
        details = event["details"]
        for phase in details["phases"]:
            rows.append(
                {
                    "attempt": details["attempt"],
                    "cause": details["cause"],
                    "phase": phase["phase"],
                    "seconds": f"{phase['seconds']:.2f}",
                    "since_start": f"{phase['since_start_s']:.2f}",
                    "detail": phase["detail"],
                }
            )
    table(rows, ["attempt", "cause", "phase", "seconds", "since_start", "detail"])


@app.command()
def metrics(
    ctx: typer.Context, job_id: int, since_step: Annotated[int, typer.Option(min=0)] = 0
) -> None:
    """Reported training metrics, per step."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/metrics", params={"since_step": since_step})
    extra = sorted({k for row in rows for k in row} - {"step", "attempt", "at"})
    table(rows, ["step", "attempt", *extra])


@app.command()
def checkpoints(ctx: typer.Context, job_id: int) -> None:
    """Committed checkpoints, newest first."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/checkpoints")
    table(rows, ["step", "attempt", "world_size", "bytes", "committed_at", "path"])


@app.command()
def cancel(ctx: typer.Context, job_id: int) -> None:
    """Cancel a job (at once when pending; a running one stops at its next step)."""
    job = api(ctx).call("POST", f"/v1/jobs/{job_id}/cancel")
    note = "" if job["state"] in TERMINAL else " (cancel requested)"
    typer.echo(f"{job['id']}\t{job['state']}{note}")


@app.command()
def checkpoint(ctx: typer.Context, job_id: int) -> None:
    """Ask a running job to save a checkpoint now."""
    job = api(ctx).call("POST", f"/v1/jobs/{job_id}/checkpoint")
    typer.echo(f"{job['id']}\t{job['state']} (checkpoint requested)")


@app.command()
def logs(
    ctx: typer.Context,
    job_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until it ends.")
    ] = False,
    attempt: Annotated[int | None, typer.Option(help="Default: the newest.")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with -f.")] = 1.0,
) -> None:
    """Print a job's worker logs; -f follows them, across restarts, until the job ends."""
    client = api(ctx)
    offset = "0"
    while True:
        params: dict[str, Any] = {"offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        chunk = client.call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        if chunk["text"]:
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
        offset = chunk["next_offset"]
        if chunk["attempt"] is not None:
            attempt = chunk["attempt"]
        if not follow:
            return
        if chunk["text"]:
            continue  # more may be waiting: read on before sleeping
        latest = chunk["latest_attempt"]
        if latest is not None and attempt is not None and latest > attempt:
            attempt, offset = latest, "0"  # a restart: move on to the new attempt's logs
            continue
        if client.call("GET", f"/v1/jobs/{job_id}")["state"] in TERMINAL:
            # One last read: lines written between our read and the job's end.
            tail = client.call(
                "GET", f"/v1/jobs/{job_id}/logs", params={**params, "offset": offset}
            )
            sys.stdout.write(tail["text"])
            return
        time.sleep(interval)


if __name__ == "__main__":
    app()
