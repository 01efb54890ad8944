"""Markdown helpers for the bench reports: a report's headline table, and a generated block
between markers in a hand-written document (the text around the markers stays)."""

from __future__ import annotations

BEGIN, END = "<!-- bench:all:begin -->", "<!-- bench:all:end -->"


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


def replace_block(document: str, block: str) -> str:
    """`document` with what is between the markers replaced by `block`; the markers and
    the block appended at the end where the document has none."""
    wrapped = f"{BEGIN}\n{block.strip()}\n{END}"
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        return head + wrapped + rest.split(END, 1)[1]
    return document.rstrip("\n") + "\n\n" + wrapped + "\n"
