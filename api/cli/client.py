"""The commands that speak REST: submit, watch and steer jobs, and see who you are.

Kept light: importing it loads neither the service nor FastAPI.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from elastrain.api.cli.connection import Api, api
from elastrain.api.cli.output import cell, duration, fail, printable, size, table

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def load_spec(path: Path) -> dict[str, Any]:
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
    spec = load_spec(file)
    if working_dir is not None:
        workload = spec.get("workload")
        if not isinstance(workload, dict):
            fail(f"{file}: workload must be a mapping to use --working-dir", code=2)
        workload["package"] = upload_working_dir(api(ctx), working_dir)
    job = api(ctx).call("POST", "/v1/jobs", json=spec)
    typer.echo(f"{job['id']}\t{job['state']}")


def upload_working_dir(client: Api, root: Path) -> str:
    """Package `root` and upload it unless the service has that content: its digest."""
    from elastrain.api.workdir import pack  # pathspec and zipping only when asked for
    from elastrain.contracts.packages import PackageRefused

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


def status(ctx: typer.Context, job_id: int) -> None:
    """Show one job."""
    job = api(ctx).call("GET", f"/v1/jobs/{job_id}")
    for key in [
        "id", "name", "owner", "state", "state_reason", "priority", "attempt", "restarts",
        "world_size", "step", "max_steps", "latest_loss", "labels", "cancel_requested",
        "created_at", "started_at", "finished_at", "last_error",
    ]:  # fmt: skip
        typer.echo(f"{key + ':':<18}{cell(job.get(key))}")
    typer.echo(f"{'goodput:':<18}{goodput_line(job.get('goodput'))}")
    spec = job["spec"]
    typer.echo(
        f"{'spec:':<18}{_strategy(spec['strategy']['kind'], job.get('strategy'))}, workers "
        f"{spec['scaling']['min_workers']}..{spec['scaling']['max_workers']}, "
        f"global batch {spec['training']['global_batch_size']}"
    )
    workload = spec["workload"]
    code = workload.get("name") or workload.get("entrypoint")
    if workload.get("command"):
        code = shlex.join(workload["command"])
    typer.echo(f"{'workload:':<18}{cell(code)}")
    if workload.get("package"):
        typer.echo(f"{'package:':<18}{cell(workload['package'])}")
    if workload.get("requirements"):
        typer.echo(f"{'requirements:':<18}{cell(' '.join(workload['requirements']))}")


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


def goodput_line(split: dict[str, Any] | None) -> str:
    """`62% of 5m10s: training 3m12s, recovering 40s, ...` (the non-zero parts)."""
    if not split or split.get("goodput") is None:
        return "-"
    parts = [
        f"{label} {duration(split[key])}"
        for key, label in _GOODPUT_PARTS
        if split.get(key, 0) >= 0.05
    ]
    return f"{split['goodput']:.0%} of {duration(split['wall_s'])}: {', '.join(parts)}"


def events(ctx: typer.Context, job_id: int) -> None:
    """Every transition and notable event of a job."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/events")
    for row in rows:
        row["transition"] = (
            f"{row['from_state'] or ''}->{row['to_state']}" if row["to_state"] else row["kind"]
        )
        row["world"] = f"{cell(row['world_size_before'])}->{cell(row['world_size_after'])}"
    table(rows, ["at", "transition", "world", "attempt", "step", "reason"])


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


def metrics(
    ctx: typer.Context, job_id: int, since_step: Annotated[int, typer.Option(min=0)] = 0
) -> None:
    """Reported training metrics, per step."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/metrics", params={"since_step": since_step})
    extra = sorted({k for row in rows for k in row} - {"step", "attempt", "at"})
    table(rows, ["step", "attempt", *extra])


def checkpoints(ctx: typer.Context, job_id: int) -> None:
    """Committed checkpoints, newest first."""
    rows = api(ctx).call("GET", f"/v1/jobs/{job_id}/checkpoints")
    table(rows, ["step", "attempt", "world_size", "bytes", "committed_at", "path"])


def export(
    ctx: typer.Context,
    job_id: int,
    out: Annotated[Path, typer.Option("--out", help="The folder to write the model to.")],
    fmt: Annotated[str, typer.Option("--format", help="hf: a Hugging Face model folder.")] = "hf",
    step: Annotated[
        int | None, typer.Option(help="The checkpoint's step (default: the newest).")
    ] = None,
) -> None:
    """Write a committed checkpoint's model as a Hugging Face folder (config.json,
    model.safetensors): hf_causal_lm jobs, and gpt jobs as GPT-2."""
    import tarfile
    import tempfile

    params: dict[str, Any] = {"format": fmt}
    if step is not None:
        params["step"] = step
    with tempfile.TemporaryFile() as archive:
        headers = api(ctx).download(f"/v1/jobs/{job_id}/export", archive, params=params)
        archive.seek(0)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=archive) as tar:
            names = tar.getnames()
            tar.extractall(out, filter="data")  # plain files only, inside `out`
    typer.echo(f"step {headers.get('x-elastrain-step', '?')}: {', '.join(sorted(names))} in {out}")


def cancel(ctx: typer.Context, job_id: int) -> None:
    """Cancel a job (at once when pending; a running one stops at its next step)."""
    job = api(ctx).call("POST", f"/v1/jobs/{job_id}/cancel")
    note = "" if job["state"] in TERMINAL else " (cancel requested)"
    typer.echo(f"{job['id']}\t{job['state']}{note}")


def checkpoint(ctx: typer.Context, job_id: int) -> None:
    """Ask a running job to save a checkpoint now."""
    job = api(ctx).call("POST", f"/v1/jobs/{job_id}/checkpoint")
    typer.echo(f"{job['id']}\t{job['state']} (checkpoint requested)")


def logs(
    ctx: typer.Context,
    job_id: int,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until it ends.")
    ] = False,
    attempt: Annotated[int | None, typer.Option(help="Default: the newest.")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with -f.")] = 1.0,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Print the logs byte for byte, terminal escapes included (a job's code "
            "writes them: only for logs you trust).",
        ),
    ] = False,
) -> None:
    """Print a job's worker logs; -f follows them, across restarts, until the job ends.

    Control characters (ESC and so CSI/OSC sequences, the other C0 and C1 controls but
    newline and tab) are shown as escapes such as \x1b: a job's log cannot retitle,
    clear or write the clipboard of the terminal that reads it. --raw prints them as they
    are."""
    client = api(ctx)
    show = _write_raw if raw else _write_safe
    offset = "0"
    while True:
        params: dict[str, Any] = {"offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        chunk = client.call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        if chunk["text"]:
            show(chunk["text"])
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
            show(tail["text"])
            return
        time.sleep(interval)


def _write_raw(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_safe(text: str) -> None:
    # Character by character, so a sequence split between two reads is escaped as well.
    _write_raw(printable(text))


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
    body: dict[str, Any] = {"spec": load_spec(file), "world_size": world_size}
    if device_memory is not None:
        body["device_memory_bytes"] = parse_bytes(device_memory)
    made = api(ctx).call("POST", "/v1/plan", json=body)
    typer.echo(
        f"{made['params']:,} parameters; {size(made['usable_bytes'])} usable of "
        f"{size(made['device_memory_bytes'])} per worker ({made['memory_source']})"
    )
    for one in made["plans"]:
        typer.echo(f"\nworld size {one['world_size']}:")
        rows = [
            {**r, **{k: size(r[k]) for k in ("params", "grads", "optimizer", "extra",
                                                "activations", "total")},
             "fits": "yes" if r["fits"] else "no"}
            for r in one["rows"]
        ]  # fmt: skip
        table(rows, ["strategy", "params", "grads", "optimizer", "extra", "activations",
                     "total", "fits", "note"])  # fmt: skip
        typer.echo(f"choice: {one['why']}")


def whoami(ctx: typer.Context) -> None:
    """The tenant (and admin or not) your token acts for."""
    me = api(ctx).call("GET", "/v1/me")
    auth = "" if me["auth"] else " (authentication is off on this service)"
    typer.echo(f"{printable(me['tenant'])}{' (admin)' if me['admin'] else ''}{auth}")
