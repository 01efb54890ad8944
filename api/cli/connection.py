"""How the commands reach the REST API: the HTTP client, and where on the command line its
connection options (`--url`, `--token`) may stand."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

import httpx
import typer

from elastrain.api.cli.output import fail

DEFAULT_URL = "http://127.0.0.1:8000"

#: The options the top-level command parses, which `elastrain COMMAND ... --url URL` may
#: also give after the command (as kubectl, gh and `ray job submit --address` allow).
CONNECTION_OPTIONS = ("--url", "--token")


class Api:
    """A thin HTTP client that turns every failure into a message and an exit code."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
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


def api(ctx: typer.Context) -> Api:
    """The client the top-level command made from `--url` and `--token`."""
    client: Api = ctx.obj
    return client


def hoist_connection_options(args: Sequence[str], *, offline: Collection[str]) -> list[str]:
    """`args` with the connection options given after the command moved before it, where
    the top-level command parses them: `submit job.yaml --url U` reads as
    `--url U submit job.yaml`. Moved after any given before, so the one nearer the end
    wins, as a repeated option does. Left alone: everything after `--`, an option whose
    value is missing (the command refuses it), and commands in `offline`, which speak no
    REST (so `serve --url U` is still refused)."""
    args = list(args)
    # The top-level options come first; the first word that is not one is the command.
    at = 0
    while at < len(args) and args[at].startswith("-"):
        at += 2 if args[at] in CONNECTION_OPTIONS else 1
    if at >= len(args) or args[at] in offline:
        return args
    command, rest = args[: at + 1], args[at + 1 :]
    hoisted: list[str] = []
    kept: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            kept += rest[i:]
            break
        if arg in CONNECTION_OPTIONS and i + 1 < len(rest):
            hoisted += rest[i : i + 2]
            i += 2
            continue
        if arg.partition("=")[0] in CONNECTION_OPTIONS and "=" in arg:
            hoisted.append(arg)
        else:
            kept.append(arg)
        i += 1
    return [*command[:-1], *hoisted, command[-1], *kept]
