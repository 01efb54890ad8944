"""How the commands reach the REST API: the HTTP client, and its connection options
(`--url`, `--token`), which stand before the command or after it."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import IO, Annotated, Any

import httpx
import typer

from elastrain.api.cli.output import fail

DEFAULT_URL = "http://127.0.0.1:8000"


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
        if response.status_code == 204:  # done, nothing to say (e.g. a share withdrawn)
            return None
        return response.json()

    def using(self, *, url: str | None = None, token: str | None = None) -> Api:
        """This client with `url` or `token` replaced (None: kept)."""
        return Api(self.url if url is None else url, self.token if token is None else token)

    def download(self, path: str, sink: IO[bytes], **kwargs: Any) -> httpx.Headers:
        """GET `path` into `sink`, streamed, with no read timeout (the server may take a
        while to make what it sends); a clear failure on an error status."""
        try:
            with self.http.stream(
                "GET", path, timeout=httpx.Timeout(30.0, read=None), **kwargs
            ) as r:
                if r.is_error:
                    r.read()
                    fail(f"error {r.status_code}: {_error_message(r)}")
                for chunk in r.iter_bytes():
                    sink.write(chunk)
                return r.headers
        except httpx.TransportError as exc:
            fail(f"cannot reach the elastrain API at {self.url} ({exc})", code=2)

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
    """The client the top-level command made from `--url` and `--token` (replaced by
    those given after the command, `accept_connection_options`)."""
    client: Api = ctx.obj
    return client


#: The connection options every REST command also takes after its name, with no
#: environment variable of their own: given, they win over the top-level ones (given before
#: the command, or ELASTRAIN_URL / ELASTRAIN_TOKEN); left out, those apply.
UrlAfter = Annotated[
    str | None,
    typer.Option(
        "--url",
        show_default=False,
        help="The elastrain API (here or before the command; default ELASTRAIN_URL).",
    ),
]
TokenAfter = Annotated[
    str | None,
    typer.Option(
        "--token",
        show_default=False,
        help="API token (here or before the command; default ELASTRAIN_TOKEN).",
    ),
]


def connected(command: Callable[..., None]) -> Callable[..., None]:
    """`command` taking `--url` and `--token` after its name as well (`elastrain submit
    job.yaml --url URL`), as kubectl, gh and `ray job submit --address` take theirs: the
    same two typed options added to each REST command's signature (typer reads it), and
    the client in its context replaced by what they name. The command is written once,
    with a `ctx` parameter, and never sees them."""
    signature = inspect.signature(command, eval_str=True)
    if "ctx" not in signature.parameters:
        raise TypeError(f"{command.__name__}: a REST command takes ctx (its client is there)")

    @functools.wraps(command)
    def run(*args: Any, url: str | None = None, token: str | None = None, **kwargs: Any) -> None:
        if url is not None or token is not None:
            ctx: typer.Context = kwargs["ctx"]
            ctx.obj = api(ctx).using(url=url, token=token)
        command(*args, **kwargs)

    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
        for name, kind in (("url", UrlAfter), ("token", TokenAfter))
    ]
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), *extra]
    )
    run.__annotations__ = {**command.__annotations__, "url": UrlAfter, "token": TokenAfter}
    return run
