"""`elastrain`: the command line. Everything but `serve` talks to the REST API over HTTP.

Kept light: importing it loads neither the service nor FastAPI; `serve` imports them.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import httpx
import typer
import yaml

if TYPE_CHECKING:
    from service.settings import Settings

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

    def exists(self, path: str) -> bool:
        """GET `path`: True on 200, False on 404, a clear failure on anything else."""
        try:
            response = self.http.get(path)
        except httpx.TransportError as exc:
            fail(f"cannot reach the elastrain API at {self.url} ({exc})", code=2)
        if response.status_code == 404:
            return False
        if response.is_error:
            fail(f"error {response.status_code}: {_error_message(response)}")
        return True


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
    typer.echo(f"elastrain: {printable(message)}", err=True)
    raise typer.Exit(code)


def printable(text: str) -> str:
    """`text` with control characters (terminal escapes, NUL, bidi overrides) shown as
    escapes: what the service stores is never allowed to drive the user's terminal."""
    return "".join(
        repr(ch)[1:-1] if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf") else ch
        for ch in text
    )


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
        return printable(",".join(f"{k}={v}" for k, v in value.items())) or "-"
    text = printable(str(value)).replace("\n", " ")
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

    from api.main import create_app
    from service.logs import configure_logging
    from service.settings import Settings

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
    if demo:
        _submit_demo_when_up(f"http://{host}:{port}")
    # log_config None: our handlers (text or JSON), not uvicorn's.
    served: dict[str, Any] = {"host": host, "port": port, "log_level": "info",
                              "access_log": False, "log_config": None}  # fmt: skip
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

    from service.db import make_engine, make_session_factory, migrate
    from service.scheduler import start_scheduler_thread

    settings.ensure_dirs()
    engine = make_engine(settings.database_url)
    migrate(engine)
    scheduler = start_scheduler_thread(settings, make_session_factory(engine)) if schedule else None
    try:
        uvicorn.run("api.main:create_app", factory=True, workers=workers, **served)
    finally:
        if scheduler is not None:
            scheduler.stop()
        engine.dispose()


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
    working_dir: Annotated[
        Path | None,
        typer.Option(
            "--working-dir",
            "-w",
            help="Ship this directory with the job: uploaded once (by content), importable "
            "on every worker; workload.entrypoint is looked up in it. Honours .gitignore "
            "and .elastrainignore.",
        ),
    ] = None,
) -> None:
    """Submit a job; prints its id and state."""
    spec = _load_spec(file)
    if working_dir is not None:
        workload = spec.get("workload")
        if not isinstance(workload, dict):
            fail(f"{file}: workload must be a mapping to use --working-dir", code=2)
        workload["package"] = upload_working_dir(api(ctx), working_dir)
    job = api(ctx).call("POST", "/v1/jobs", json=spec)
    typer.echo(f"{job['id']}\t{job['state']}")


def upload_working_dir(client: Api, root: Path) -> str:
    """Package `root` and upload it unless the service has that content: its digest."""
    from api.workdir import pack  # pathspec and zipping only when asked for
    from contracts.packages import PackageRefused

    try:
        packed = pack(root)
    except (PackageRefused, OSError) as exc:
        fail(f"--working-dir: {exc}", code=2)
    try:
        digest = packed.manifest.digest
        if not client.exists(f"/v1/packages/{digest}"):
            with open(packed.archive, "rb") as body:
                client.call(
                    "POST",
                    "/v1/packages",
                    content=body,
                    headers={"Content-Type": "application/zip"},
                )
        files = len(packed.manifest.files)
        typer.echo(f"package {digest} ({files} files from {root})", err=True)
        return digest
    finally:
        packed.archive.unlink(missing_ok=True)


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
    typer.echo(f"{'goodput:':<18}{_goodput_line(job.get('goodput'))}")
    spec = job["spec"]
    typer.echo(
        f"{'spec:':<18}{_strategy(spec['strategy']['kind'], job.get('strategy'))}, workers "
        f"{spec['scaling']['min_workers']}..{spec['scaling']['max_workers']}, "
        f"global batch {spec['training']['global_batch_size']}"
    )
    workload = spec["workload"]
    code = workload.get("name") or workload.get("entrypoint")
    typer.echo(f"{'workload:':<18}{_cell(code)}")
    if workload.get("package"):
        typer.echo(f"{'package:':<18}{_cell(workload['package'])}")
    if workload.get("requirements"):
        typer.echo(f"{'requirements:':<18}{_cell(' '.join(workload['requirements']))}")


def _strategy(kind: str, running: str | None) -> str:
    """`fsdp+tp2`, or for an auto job `auto (fsdp)`: what its current attempt runs."""
    if kind == "auto":
        return f"auto ({running})" if running and running != "auto" else "auto (not planned yet)"
    return running or kind


_GOODPUT_PARTS = [
    ("training_s", "training"), ("recomputed_s", "recomputed"), ("queued_s", "queued"),
    ("starting_s", "starting"), ("recovering_s", "recovering"), ("resizing_s", "resizing"),
    ("checkpoint_stall_s", "checkpoint stalls"), ("other_s", "other"),
]  # fmt: skip


def _goodput_line(split: dict[str, Any] | None) -> str:
    """`62% of 5m10s: training 3m12s, recovering 40s, ...` (the non-zero parts)."""
    if not split or split.get("goodput") is None:
        return "-"
    parts = [
        f"{label} {_duration(split[key])}"
        for key, label in _GOODPUT_PARTS
        if split.get(key, 0) >= 0.05
    ]
    return f"{split['goodput']:.0%} of {_duration(split['wall_s'])}: {', '.join(parts)}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


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


# --- access: tokens and tenants -------------------------------------------------------


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """`16GiB`, `512M`, `1.5g`, `1000000` -> bytes (binary units)."""
    raw = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = raw[-1] if raw and raw[-1] in _UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)] if unit else raw)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size such as 16GiB or 512MiB") from None
    if value <= 0:
        raise typer.BadParameter(f"{text!r}: must be > 0")
    return int(value * _UNITS[unit])


@app.command()
def plan(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON ('-' for stdin).")],
    device_memory: Annotated[
        str | None,
        typer.Option(help="Memory one worker has, e.g. 80GiB (default: the cluster's CPU share)."),
    ] = None,
    world_size: Annotated[int | None, typer.Option(min=1, help="Only this world size.")] = None,
) -> None:
    """The job's memory plan: bytes per rank for each strategy, which fit, and the choice."""
    body: dict[str, Any] = {"spec": _load_spec(file), "world_size": world_size}
    if device_memory is not None:
        body["device_memory_bytes"] = parse_bytes(device_memory)
    made = api(ctx).call("POST", "/v1/plan", json=body)
    typer.echo(
        f"{made['params']:,} parameters; {_size(made['usable_bytes'])} usable of "
        f"{_size(made['device_memory_bytes'])} per worker ({made['memory_source']})"
    )
    for one in made["plans"]:
        typer.echo(f"\nworld size {one['world_size']}:")
        rows = [
            {**r, **{k: _size(r[k]) for k in ("params", "grads", "optimizer", "extra",
                                                "activations", "total")},
             "fits": "yes" if r["fits"] else "no"}
            for r in one["rows"]
        ]  # fmt: skip
        table(rows, ["strategy", "params", "grads", "optimizer", "extra", "activations",
                     "total", "fits", "note"])  # fmt: skip
        typer.echo(f"choice: {one['why']}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@app.command("prepare-text")
def prepare_text(
    source: Annotated[Path, typer.Argument(help="A UTF-8 text file.")],
    out_dir: Annotated[
        Path, typer.Argument(help="Where to write train.bin, val.bin and meta.json.")
    ],
    eval_fraction: Annotated[
        float, typer.Option(help="The share of the text (its end) held out in val.bin.")
    ] = 0.1,
) -> None:
    """Make the gpt workload's token files from a text file (runs here, no server)."""
    from api.prepare_text import PrepareError
    from api.prepare_text import prepare_text as prepare
    from service.settings import Settings

    try:
        done = prepare(source, out_dir, eval_fraction=eval_fraction)
    except PrepareError as exc:
        fail(str(exc), code=2)
    typer.echo(
        f"{done.train_tokens} training and {done.val_tokens} held-out tokens, "
        f"vocabulary {done.vocab_size} ({done.token_dtype}) in {out_dir}",
        err=True,
    )
    root = Settings().storage_path
    folder = out_dir.resolve()
    if folder.is_relative_to(root):
        folder = folder.relative_to(root)
    else:
        typer.echo(
            f"note: {out_dir} is not under the storage root ({root}): copy it there and "
            "name it from the root",
            err=True,
        )
    params: dict[str, Any] = {
        "data_path": str(folder / "train.bin"),
        "token_dtype": done.token_dtype,
        "vocab_size": done.vocab_size,
    }
    if done.val_tokens:
        params["eval_path"] = str(folder / "val.bin")
    typer.echo(json.dumps({"workload": {"name": "gpt", "params": params}}))


token_app = typer.Typer(help="API tokens: a token is the right to run code on the cluster.")
tenant_app = typer.Typer(help="Tenants and their quotas of running workers (admin).")
app.add_typer(token_app, name="token")
app.add_typer(tenant_app, name="tenant")

_TOKEN_COLUMNS = ["id", "tenant", "admin", "name", "prefix", "created_at", "revoked_at"]


@app.command()
def whoami(ctx: typer.Context) -> None:
    """The tenant (and admin or not) your token acts for."""
    me = api(ctx).call("GET", "/v1/me")
    auth = "" if me["auth"] else " (authentication is off on this service)"
    typer.echo(f"{printable(me['tenant'])}{' (admin)' if me['admin'] else ''}{auth}")


@token_app.command("create")
def token_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="Whose token: its jobs are the tenant's.")],
    admin: Annotated[bool, typer.Option("--admin", help="Sees and acts on all jobs.")] = False,
    name: Annotated[str, typer.Option(help="What it is for.")] = "",
    database_url: Annotated[
        str | None,
        typer.Option(
            help="Write it straight into this database instead of asking the API: how the "
            "first admin token is made when no ELASTRAIN_API_TOKEN is set."
        ),
    ] = None,
) -> None:
    """Create a token. It is printed once (stdout); the service keeps only its hash."""
    if database_url is not None:
        made = _create_token_in_db(database_url, tenant=tenant, admin=admin, name=name)
    else:
        body = {"tenant": tenant, "admin": admin, "name": name}
        made = api(ctx).call("POST", "/v1/tokens", json=body)
    typer.echo(
        f"token {made['id']} for tenant {printable(made['tenant'])}"
        f"{' (admin)' if made['admin'] else ''}: keep it secret, it is not shown again",
        err=True,
    )
    typer.echo(made["token"])


def _create_token_in_db(url: str, *, tenant: str, admin: bool, name: str) -> dict[str, Any]:
    from pydantic import ValidationError

    from api.schemas import TokenCreate
    from service import auth
    from service.db import make_engine, make_session_factory, migrate, session_scope

    try:
        TokenCreate(tenant=tenant, admin=admin, name=name)
    except ValidationError as exc:
        fail("; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors()), code=2)
    engine = make_engine(url)
    try:
        migrate(engine)
        with session_scope(make_session_factory(engine)) as session:
            row, token = auth.create_token(session, tenant=tenant, admin=admin, name=name)
            return {"id": row.id, "tenant": row.tenant, "admin": row.admin, "token": token}
    finally:
        engine.dispose()


@token_app.command("list")
def token_list(ctx: typer.Context) -> None:
    """Tokens (an admin sees every tenant's; others their own tenant's)."""
    table(api(ctx).call("GET", "/v1/tokens"), _TOKEN_COLUMNS)


@token_app.command("revoke")
def token_revoke(ctx: typer.Context, token_id: int) -> None:
    """Revoke a token; it stops working within seconds."""
    row = api(ctx).call("DELETE", f"/v1/tokens/{token_id}")
    typer.echo(f"{row['id']}\trevoked {_cell(row['revoked_at'])}")


@tenant_app.command("list")
def tenant_list(ctx: typer.Context) -> None:
    """Tenants, their quotas and the workers their jobs hold now."""
    table(api(ctx).call("GET", "/v1/tenants"), ["name", "max_workers", "quota", "workers_in_use"])


@tenant_app.command("set")
def tenant_set(
    ctx: typer.Context,
    name: str,
    max_workers: Annotated[
        int | None, typer.Option(min=1, help="Most workers its jobs may hold at once.")
    ] = None,
    no_quota: Annotated[
        bool, typer.Option("--no-quota", help="Remove its own quota (the default applies).")
    ] = False,
) -> None:
    """Set a tenant's quota of running workers (creates the tenant if new)."""
    if (max_workers is None) == (not no_quota):
        fail("give exactly one of --max-workers N or --no-quota", code=2)
    row = api(ctx).call("PUT", f"/v1/tenants/{name}", json={"max_workers": max_workers})
    table([row], ["name", "max_workers", "quota", "workers_in_use"])


if __name__ == "__main__":
    app()
