"""The cluster's nodes: see them, drain one before it goes, undrain it (drain and undrain
need an admin token). Like `kubectl drain`: jobs leave a drained node at a step boundary
(their state handed on in memory), nothing new is placed there; a job whose min_workers
do not fit elsewhere checkpoints and stays until the deadline, then stops with a
checkpoint and waits."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from elastrain.api.cli.connection import api
from elastrain.api.cli.output import cell, duration, printable, table


def cluster(ctx: typer.Context) -> None:
    """Nodes, their free CPUs/GPUs, the jobs on them, which are draining (and why), and
    which just joined and are still starting their worker processes (warming)."""
    view = api(ctx).call("GET", "/v1/cluster")
    if not view["connected"]:
        typer.echo("(no fresh snapshot: is a scheduler connected to Ray?)", err=True)
    rows = [_row(node) for node in view["nodes"]]
    table(rows, ["node", "address", "state", "cpus", "gpus", "jobs", "drain"])


def _row(node: dict[str, Any]) -> dict[str, Any]:
    drain = node.get("drain")
    state = (
        "dead"
        if not node["alive"]
        else "draining"
        if drain
        else "warming"
        if node.get("warming")
        else "alive"
    )
    return {
        "node": node["node_id"][:12],
        "address": node["address"],
        "state": state,
        "cpus": f"{node['cpus_free']:g}/{node['cpus_total']:g}",
        "gpus": f"{node['gpus_free']:g}/{node['gpus_total']:g}",
        "jobs": ",".join(str(j) for j in node["jobs"]) or "-",
        "drain": describe_drain(drain) if drain else "-",
    }


def describe_drain(drain: dict[str, Any], now: float | None = None) -> str:
    """`admin: kernel upgrade, deadline in 4m10s` (what drained it, why, until when)."""
    parts = [f"{drain['source']}: {printable(drain['reason']) or 'no reason given'}"]
    deadline = drain.get("deadline")
    if deadline is not None:
        left = deadline - (time.time() if now is None else now)
        parts.append(f"deadline in {duration(left)}" if left > 0 else "deadline passed")
    return ", ".join(parts)


def drain(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The node's Ray id or a unique prefix (6+).")],
    deadline: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds until the node goes: a job that cannot leave checkpoints and "
            "stops by then.",
        ),
    ] = None,
    reason: Annotated[str, typer.Option(help="Why (shown by `elastrain cluster`).")] = "",
) -> None:
    """Drain a node: jobs leave it at a step boundary; nothing new is placed there."""
    made = api(ctx).call(
        "POST",
        f"/v1/cluster/nodes/{node}/drain",
        json={"deadline_s": deadline, "reason": reason},
    )
    until = f", deadline {cell(made['deadline'])}" if made["deadline"] else ""
    typer.echo(f"{made['node_id'][:12]}\tdraining{until}")


def undrain(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The node's Ray id or a unique prefix (6+).")],
) -> None:
    """Undrain a node: its capacity is back; jobs may grow onto it again."""
    made = api(ctx).call("POST", f"/v1/cluster/nodes/{node}/undrain")
    typer.echo(f"{made['node_id'][:12]}\tundrained")
