"""The commands the README and the docs pages (docs/*.md) show stay true: every
`elastrain ...` line in their code blocks names a command the CLI has, with options that
command takes; every `examples/...` path they name exists, each example spec valid (the
ones whose code comes with `--working-dir` refused without it, saying so); every REST call
they name (`GET /v1/...`) is one the API serves; every `ELASTRAIN_*` variable they name is
read somewhere. Nothing is run: the commands are parsed against the CLI's own definition,
the calls looked up in the API's OpenAPI description."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import ValidationError

from elastrain.api.cli import app
from elastrain.contracts.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]
# The README and every page of the docs site it points to (docs/*.md; the reference pages
# are generated from the code itself): every command a user reads.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README = "\n".join(page.read_text() for page in PAGES)
CODE = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", README, re.S))


def command_lines() -> list[str]:
    """Each `elastrain ...` invocation in the README's code blocks: comments, optional
    `[...]` parts and shell around it dropped; `a / elastrain b` gives two."""
    out = []
    for line in CODE.splitlines():
        line = line.split("#", 1)[0]
        line = re.sub(r"\[[^\]]*\]", " ", line)
        for part in line.split(" / "):
            match = re.search(r"(?:^|[\s/])elastrain\s+(.*)$", part)
            if match:
                out.append(match.group(1).rstrip(" &"))
    return out


def resolve(args: list[str]) -> tuple[Any, list[str]]:
    """The (sub)command `args` names and the arguments left after its name. (Typer's
    commands are its own click's: looked at by their attributes, not their classes.)"""
    command: Any = typer.main.get_command(app)
    while getattr(command, "commands", None) and args and not args[0].startswith("-"):
        name, args = args[0], args[1:]
        assert name in command.commands, f"no command {name!r} (has: {sorted(command.commands)})"
        command = command.commands[name]
    return command, args


LINES = command_lines()


def test_the_readme_has_command_lines() -> None:
    assert len(LINES) >= 20


@pytest.mark.parametrize("line", LINES)
def test_each_readme_command_line_parses_against_the_cli(line: str) -> None:
    command, rest = resolve(shlex.split(line))
    assert not getattr(command, "commands", None), f"{line!r} names a group, not a command"
    known = {opt for param in command.params for opt in param.opts}
    for token in rest:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in known, f"{line!r}: {token} is not an option of it"


def test_every_examples_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"examples/[\w./-]*\w", README))
    assert named
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert not missing


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_each_example_spec_is_valid(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())
    try:
        JobSpec.model_validate(spec)
    except ValidationError as exc:  # code shipped with the job: refused without it
        assert "--working-dir" in str(exc), exc
        assert (path.parent / path.stem).is_dir(), f"{path.name} needs a folder to ship"


def test_every_rest_call_the_readme_names_is_served(tmp_path: Path) -> None:
    from elastrain.api.main import create_app
    from elastrain.service.settings import Settings

    app = create_app(
        Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_path=tmp_path / "st")
    )

    def shape(path: str) -> str:  # `{id}` in the README, `{job_id}` in the app
        return re.sub(r"\{[^}]*\}", "{}", path)

    served = {(m.upper(), shape(p)) for p, ops in app.openapi()["paths"].items() for m in ops}
    named = {
        (method, shape(path))
        for method, path in re.findall(
            r"(GET|POST|PUT|PATCH|DELETE)\s+`?(/v1/[\w{}/.\-]*\w\}?)", README
        )
    }
    assert len(named) >= 15
    assert sorted(named - served) == []


def test_every_environment_variable_the_readme_names_is_read() -> None:
    from elastrain.service.settings import Settings

    named = set(re.findall(r"ELASTRAIN_[A-Z0-9_]*[A-Z0-9]", README))
    settings = {f"ELASTRAIN_{name.upper()}" for name in Settings.model_fields}
    sources = [
        path
        for folder in ("api", "service", "workers", "checkpoints", "contracts", "bench", "tests")
        for path in (REPO / folder).rglob("*.py")
    ] + [REPO / "Makefile", *(REPO / ".ci").iterdir()]
    read = set()
    for path in sources:
        if path.is_file():
            read |= set(re.findall(r"ELASTRAIN_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert len(named) >= 10
    assert sorted(named - settings - read) == []
