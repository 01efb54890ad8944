"""What every command prints: errors with their exit code, tables, sizes and durations, and
stored text made safe for the user's terminal."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any, NoReturn

import typer


def fail(message: str, *, code: int = 1) -> NoReturn:
    typer.echo(f"elastrain: {printable(message)}", err=True)
    raise typer.Exit(code)


def printable(text: str) -> str:
    """`text` with control characters (terminal escapes, NUL, bidi overrides) shown as
    escapes: what the service stores is never allowed to drive the user's terminal."""
    return "".join(
        repr(ch)[1:-1] if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf") else ch
        for ch in text
    )


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return printable(",".join(f"{k}={v}" for k, v in value.items())) or "-"
    text = printable(str(value)).replace("\n", " ")
    # ISO timestamps: seconds are plenty in a table.
    if len(text) >= 19 and text[4] == "-" and text[10] == "T":
        return text[:19].replace("T", " ")
    return text


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in cells)]) for i, col in enumerate(columns)]
    header = [col.upper() for col in columns]
    for line in [header, *cells]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
