"""Packages (working directories uploaded with `submit --working-dir`): see one, and share
it with another tenant or take the share back (share and unshare need an admin token). A
package is its uploader's until an admin shares it; the uploader's own access stays."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from elastrain.api.cli.connection import api
from elastrain.api.cli.output import size, table

_DIGEST = typer.Argument(help="The package's digest (sha256:...), as `submit -w` printed it.")
_GRANT_COLUMNS = ["tenant", "uploaded", "granted_by", "size", "created_at"]


def show(ctx: typer.Context, digest: Annotated[str, _DIGEST]) -> None:
    """A package's files; for an admin, also who may use it (uploaders and shares)."""
    made = api(ctx).call("GET", f"/v1/packages/{digest}")
    typer.echo(f"{made['digest']}: {made['file_count']} files, {size(made['size_bytes'])}")
    table([{**f, "size": size(f["size"])} for f in made["files"]], ["path", "size"])
    if made.get("grants") is not None:
        typer.echo("\nwho may use it:")
        _grants(made["grants"])


def share(
    ctx: typer.Context,
    digest: Annotated[str, _DIGEST],
    tenant: Annotated[str, typer.Option(help="The tenant that may use it; '*': every tenant.")],
) -> None:
    """Let a tenant (or '*': every tenant) use a package (admin)."""
    made = api(ctx).call("POST", f"/v1/packages/{digest}/share", json={"tenant": tenant})
    typer.echo(f"{made['digest']}\tshared with {tenant}", err=True)
    _grants(made["grants"])


def unshare(
    ctx: typer.Context,
    digest: Annotated[str, _DIGEST],
    tenant: Annotated[str, typer.Option(help="The tenant (or '*') whose share to withdraw.")],
) -> None:
    """Withdraw a share (admin); a tenant that uploaded the package keeps its own access."""
    client = api(ctx)
    client.call("DELETE", f"/v1/packages/{digest}/share/{tenant}")
    typer.echo(f"{digest}\tno longer shared with {tenant}", err=True)
    _grants(client.call("GET", f"/v1/packages/{digest}")["grants"] or [])


def _grants(rows: list[dict[str, Any]]) -> None:
    table(
        [{**g, "uploaded": "yes" if g["uploaded"] else "no", "size": size(g["size_bytes"])}
         for g in rows],
        _GRANT_COLUMNS,
    )  # fmt: skip
