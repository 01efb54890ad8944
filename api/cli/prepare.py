"""`elastrain prepare INPUT... --tokenizer DIR --out NAME`: tokenize data on the cluster.

Submits a job of the built-in `prepare` workload (`elastrain.workers.prepare`) through the
same REST call as any job (so it is listed, logged, retried and shown on the dashboard
like one), then, unless `--no-wait`, prints its progress until it ends and the params to
train on the result.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from elastrain.api.cli.client import TERMINAL
from elastrain.api.cli.connection import Api, api
from elastrain.api.cli.output import duration, fail, printable, size

#: The CPUs the job's own process holds: it only writes what Ray Data's tasks (a CPU each)
#: tokenize, so the cluster's CPUs go to them.
WRITER_CPUS = 0.25


def prepare_spec(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    text_field: str,
    eval_fraction: float,
    max_restarts: int = 3,
) -> dict[str, Any]:
    """The job spec `elastrain prepare` submits."""
    return {
        "name": f"prepare {out}"[:100],
        "workload": {
            "name": "prepare",
            "params": {
                "inputs": inputs,
                "tokenizer": tokenizer,
                "out": out,
                "text_field": text_field,
                "eval_fraction": eval_fraction,
            },
        },
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": WRITER_CPUS},
        "failure": {"max_restarts": max_restarts},
    }


def progress_line(point: dict[str, Any]) -> str:
    """One progress point of a prepare job (`elastrain.workers.prepare.Progress.point`)."""
    eta = point.get("eta_s")
    share = point.get("progress")
    parts = [
        f"files {point.get('files_done', 0)}/{point.get('files', '?')}",
        f"rows {int(point.get('rows') or 0):,}",
        f"{size(int(point.get('bytes') or 0))}"
        + (f" ({share:.0%})" if isinstance(share, float) else ""),
        f"tokens {int(point.get('tokens') or 0):,}",
        f"{float(point.get('tokens_per_s') or 0):,.0f} tokens/s",
        f"ETA {duration(eta)}" if isinstance(eta, (int, float)) else "ETA -",
    ]
    return "  ".join(parts)


def train_params(out: str) -> dict[str, Any]:
    """What to train on a prepared folder: its index carries the vocabulary and split."""
    return {"workload": {"name": "gpt", "params": {"data_path": out}}}


def prepare(
    ctx: typer.Context,
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Files in your data area (globs allowed, quote them): .txt, .jsonl/.json, "
            ".parquet, or a Hugging Face save_to_disk folder."
        ),
    ],
    tokenizer: Annotated[
        str, typer.Option(help="A folder in your data area holding tokenizer.json.")
    ],
    out: Annotated[str, typer.Option(help="The folder to write, in your data area.")],
    text_field: Annotated[
        str, typer.Option(help="The field/column holding the text (not for .txt files).")
    ] = "text",
    eval_fraction: Annotated[
        float, typer.Option(help="The share of documents held out (whole documents).")
    ] = 0.1,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Print progress until the job ends.")
    ] = True,
    interval: Annotated[float, typer.Option(help="Seconds between progress lines.")] = 2.0,
) -> None:
    """Tokenize text, JSON lines, Parquet or save_to_disk data on the cluster (Ray Data)
    into token shards in your data area; prints the params to train on them."""
    client = api(ctx)
    spec = prepare_spec(
        inputs, tokenizer=tokenizer, out=out, text_field=text_field, eval_fraction=eval_fraction
    )
    job = client.call("POST", "/v1/jobs", json=spec)
    typer.echo(f"{job['id']}\t{job['state']}", err=True)
    if not wait:
        return
    final = follow(client, int(job["id"]), interval)
    if final["state"] != "SUCCEEDED":
        fail(f"prepare job {job['id']} {final['state']}: {final.get('last_error') or '-'}")
    typer.echo(json.dumps(train_params(out)))


def follow(client: Api, job_id: int, interval: float) -> dict[str, Any]:
    """Print each new progress point of the job until it ends; the job, as it ended."""
    seen = -1
    while True:
        job = client.call("GET", f"/v1/jobs/{job_id}")
        rows = client.call("GET", f"/v1/jobs/{job_id}/metrics", params={"since_step": seen + 1})
        newest = max(rows, key=lambda r: (r.get("attempt") or 0, r["step"]), default=None)
        if newest is not None and newest["step"] > seen:
            seen = newest["step"]
            typer.echo(printable(progress_line(newest)), err=True)
        if job["state"] in TERMINAL:
            return job
        time.sleep(interval)
