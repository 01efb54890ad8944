"""Markdown helpers for the bench reports: a report's headline table, and generated blocks
between named markers in a hand-written document (the text around the markers stays)."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def first_table(markdown: str) -> str | None:
    """The first pipe table of `markdown` (its header, rule and rows), or None."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        rule = lines[i + 1] if i + 1 < len(lines) else ""
        if line.startswith("|") and rule.startswith("|") and set(rule) <= set("|-: "):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            return "\n".join(lines[i:end])
    return None


def replace_block(document: str, name: str, block: str) -> str:
    """`document` with what is between the markers of `name` replaced by `block`; the
    markers and the block appended at the end where the document has none. Other blocks
    (parts not run this time) stay as they were."""
    begin, end = markers(name)
    wrapped = f"{begin}\n{block.strip()}\n{end}"
    if begin in document and end in document:
        head, rest = document.split(begin, 1)
        return head + wrapped + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + wrapped + "\n"


def write_block(path: Path, name: str, block: str, *, new_document: str = "") -> None:
    """Replace the block `name` in the file at `path` (the text around it stays), starting
    from `new_document` where there is no such file yet."""
    document = path.read_text() if path.exists() else new_document
    path.write_text(replace_block(document, name, block))
