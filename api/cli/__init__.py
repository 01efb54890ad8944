"""`elastrain`: the command line, wired together. Everything but `serve` and `prepare-text`
talks to the REST API over HTTP.

The commands live by what they do: `client` (jobs, over REST), `admin` (tokens and
tenants), `nodes` (the cluster, drain and undrain), `packages` (see and share uploaded
working directories), `server` (`serve`), `offline` (tools that need no server).
Importing this loads
neither the service nor FastAPI; `serve` imports them when it runs.
"""

from __future__ import annotations

from typing import Annotated

import typer

from elastrain.api.cli import admin, client, nodes, offline, packages, prepare, server
from elastrain.api.cli.connection import DEFAULT_URL, Api, connected

#: Commands that speak no REST: `--url` and `--token` after them stay an error.
OFFLINE_COMMANDS = frozenset({"serve", "prepare-text"})

app = typer.Typer(
    name="elastrain",
    help="Elastic PyTorch training on Ray: submit, watch and steer jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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


app.command()(server.serve)
app.command()(client.submit)
app.command("list")(client.list_)
app.command()(client.status)
app.command()(client.events)
app.command()(client.timeline)
app.command()(client.metrics)
app.command()(client.checkpoints)
app.command()(client.export)
app.command()(client.cancel)
app.command()(client.checkpoint)
app.command()(client.logs)
app.command()(client.plan)
app.command()(prepare.prepare)
app.command("prepare-text")(offline.prepare_text)
app.command()(client.whoami)
app.command()(nodes.cluster)
app.command()(nodes.drain)
app.command()(nodes.undrain)

token_app = typer.Typer(help="API tokens: a token is the right to run code on the cluster.")
token_app.command("create")(admin.token_create)
token_app.command("list")(admin.token_list)
token_app.command("revoke")(admin.token_revoke)
app.add_typer(token_app, name="token")

tenant_app = typer.Typer(help="Tenants and their quotas of running workers (admin).")
tenant_app.command("list")(admin.tenant_list)
tenant_app.command("set")(admin.tenant_set)
app.add_typer(tenant_app, name="tenant")

packages_app = typer.Typer(
    help="Packages (working directories uploaded by `submit -w`): see one, share it (admin)."
)
packages_app.command("show")(packages.show)
packages_app.command("share")(packages.share)
packages_app.command("unshare")(packages.unshare)
app.add_typer(packages_app, name="packages")


def _connect(typer_app: typer.Typer) -> None:
    """Every REST command, in every group, also takes `--url` and `--token` after its
    name (`connection.connected`); the offline ones do not."""
    for info in typer_app.registered_commands:
        assert info.callback is not None
        name = info.name or info.callback.__name__.replace("_", "-")
        if name not in OFFLINE_COMMANDS:
            info.callback = connected(info.callback)
    for group in typer_app.registered_groups:
        assert group.typer_instance is not None
        _connect(group.typer_instance)


_connect(app)
