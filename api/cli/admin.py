"""Access: API tokens and tenants' quotas. Each command asks the REST API, except
`token create --database-url`, which writes the first admin token straight into the
database (the service and its migrations are imported only then)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from elastrain.api.cli.connection import api
from elastrain.api.cli.output import cell, fail, printable, table

_TOKEN_COLUMNS = ["id", "tenant", "admin", "name", "prefix", "created_at", "revoked_at"]


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

    from elastrain.api.schemas import TokenCreate
    from elastrain.service import auth
    from elastrain.service.db import make_engine, make_session_factory, migrate, session_scope

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


def token_list(ctx: typer.Context) -> None:
    """Tokens (an admin sees every tenant's; others their own tenant's)."""
    table(api(ctx).call("GET", "/v1/tokens"), _TOKEN_COLUMNS)


def token_revoke(ctx: typer.Context, token_id: int) -> None:
    """Revoke a token; it stops working within seconds."""
    row = api(ctx).call("DELETE", f"/v1/tokens/{token_id}")
    typer.echo(f"{row['id']}\trevoked {cell(row['revoked_at'])}")


def tenant_list(ctx: typer.Context) -> None:
    """Tenants, their quotas and the workers their jobs hold now."""
    table(api(ctx).call("GET", "/v1/tenants"), ["name", "max_workers", "quota", "workers_in_use"])


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
