"""MkDocs hook: the CLI and REST reference pages, generated at every build from the code
that defines them, so they cannot drift from it and are never written twice.

- `reference/cli.md`: the `elastrain` command tree (`elastrain.api.cli:app`), walked
  through typer's click commands: each command's usage, help, arguments and options, as
  `elastrain COMMAND --help` prints them.
- `reference/rest.md`: the API's OpenAPI schema (`elastrain.api.main.create_app().openapi()`):
  each path and method with its summary, parameters, request body and response codes.

The pages exist only in the build (`File.generated`): nothing is written into `docs/`.
Building the app creates no database and starts no Ray: `create_app` only wires routes;
its lifespan, which would migrate the database and start the scheduler, never runs here.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
REST_PAGE = "reference/rest.md"
_CODE_SPAN = re.compile(r"(`[^`]*`)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    files.append(File.generated(config, REST_PAGE, content=rest_reference()))
    return files


def inline(text: str) -> str:
    """Help text as one line of Markdown that reads as written: outside code spans, the
    characters Markdown or a table would take for syntax (`<tag>`, `*`, `|`) are escaped."""
    parts = _CODE_SPAN.split(" ".join(text.split()))
    return "".join(
        part
        if part.startswith("`")
        else part.replace("&", "&amp;").replace("<", "&lt;").replace("*", r"\*").replace("|", r"\|")
        for part in parts
    )


def paragraphs(text: str) -> str:
    """A docstring-style help text (paragraphs split by blank lines) as Markdown."""
    return "\n\n".join(inline(block) for block in re.split(r"\n\s*\n", text.strip()) if block)


# --- CLI ---------------------------------------------------------------------------------


def cli_reference() -> str:
    import typer

    from elastrain.api.cli import app

    root = typer.main.get_command(app)
    lines = [
        "# CLI reference",
        "",
        "Generated from the CLI's own definition (`elastrain.api.cli:app`) when these docs are",
        "built; `elastrain COMMAND --help` prints the same. `--url` and `--token` (or",
        "`ELASTRAIN_URL`, `ELASTRAIN_TOKEN`) go before or after the command.",
        "",
    ]
    for depth, path, command, ctx in _walk(root, root.context_class(root, info_name="elastrain")):
        lines += _command_section(depth, path, command, ctx)
    return "\n".join(lines) + "\n"


def _walk(command: Any, ctx: Any, depth: int = 0) -> Iterator[tuple[int, str, Any, Any]]:
    """Every command below `command` (itself first), depth first in the CLI's own order.
    (Typer's commands are its own vendored click's: used by their attributes.)"""
    yield depth, ctx.command_path, command, ctx
    for name in getattr(command, "commands", {}):
        child = command.commands[name]
        if not child.hidden:
            yield from _walk(
                child, child.context_class(child, info_name=name, parent=ctx), depth + 1
            )


def _command_section(depth: int, path: str, command: Any, ctx: Any) -> list[str]:
    heading = "#" * min(depth + 2, 4)
    out = [f"{heading} `{path}`", "", "```text", command.get_usage(ctx), "```", ""]
    if command.help:
        out += [paragraphs(command.help), ""]
    rows: dict[str, list[str]] = {"argument": [], "option": []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or "--help" in param.opts:
            continue
        names, help_text = record
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str) and envvar not in help_text:
            help_text = f"{help_text} (env `{envvar}`)"
        rows[param.param_type_name].append(f"| `{names}` | {inline(help_text)} |")
    for kind, kind_rows in rows.items():
        if kind_rows:
            out += [f"| {kind} | |", "| --- | --- |", *kind_rows, ""]
    if getattr(command, "commands", None):
        names = ", ".join(f"`{name}`" for name in command.commands)
        out += [f"Commands: {names}.", ""]
    return out


# --- REST --------------------------------------------------------------------------------


def rest_reference() -> str:
    from elastrain.api.main import create_app
    from elastrain.service.settings import Settings

    with tempfile.TemporaryDirectory(prefix="elastrain-docs-") as tmp:
        # Paths the app would use once served; creating it touches neither.
        settings = Settings(
            database_url=f"sqlite:///{Path(tmp) / 'unused.db'}", storage_path=Path(tmp) / "st"
        )
        schema = create_app(settings).openapi()
    lines = [
        "# REST reference",
        "",
        "Generated from the API's OpenAPI schema (`elastrain.api.main:create_app`) when these",
        "docs are built; a running service serves the same schema at `/openapi.json` and",
        "browses it at `/docs`. Routes marked *token* need",
        "`Authorization: Bearer <token>` when authentication is on.",
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            tag = (operation.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append((method.upper(), path, operation))
    for tag, operations in by_tag.items():
        lines += [f"## {tag}", ""]
        for method, path, operation in operations:
            lines += _operation_section(method, path, operation)
    return "\n".join(lines) + "\n"


def _operation_section(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    token = " (*token*)" if operation.get("security") else ""
    out = [f"### `{method} {path}`", "", inline(operation.get("summary", "")) + token, ""]
    if operation.get("description"):
        out += [paragraphs(operation["description"]), ""]
    parameters = operation.get("parameters", [])
    if parameters:
        out += ["| parameter | in | type | required | |", "| --- | --- | --- | --- | --- |"]
        for param in parameters:
            schema = param.get("schema", {})
            default = f"(default `{schema['default']}`)" if "default" in schema else ""
            about = " ".join(filter(None, [inline(param.get("description", "")), default]))
            out.append(
                f"| `{param['name']}` | {param['in']} | {schema_type(schema)} "
                f"| {'yes' if param.get('required') else 'no'} | {about} |"
            )
        out.append("")
    body = operation.get("requestBody")
    if body:
        kinds = ", ".join(
            f"{schema_type(content.get('schema', {}))} as `{media}`"
            for media, content in body["content"].items()
        )
        out += [f"Request body{'' if body.get('required') else ' (optional)'}: {kinds}.", ""]
    out += ["| response | | body |", "| --- | --- | --- |"]
    for code, response in operation["responses"].items():
        models = {
            schema_type(content["schema"])
            for content in response.get("content", {}).values()
            if content.get("schema")
        }
        out.append(
            f"| {code} | {inline(response.get('description', ''))} | {', '.join(sorted(models))} |"
        )
    return [*out, ""]


def schema_type(schema: dict[str, Any]) -> str:
    """A parameter's or body's type in a few characters: a model's name, `integer`,
    `list[JobState]`, `DrainRequest | null`."""
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    if "anyOf" in schema:
        return " \\| ".join(schema_type(option) for option in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list[{schema_type(schema.get('items', {}))}]"
    if "enum" in schema:
        return " \\| ".join(f"`{value}`" for value in schema["enum"])
    if "type" in schema:
        return f"{schema['type']}" + (f" ({schema['format']})" if "format" in schema else "")
    return "any"
