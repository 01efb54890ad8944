"""bench/all.py's report assembly: a part's headline table, the generated block."""

from __future__ import annotations

import pytest

from bench.report_blocks import first_table, markers, replace_block

BEGIN, END = markers("part")
OTHER = "<!-- bench:other:begin -->\nkept\n<!-- bench:other:end -->"

REPORT = """# A bench

`python bench/x.py`: words | with a pipe in prose.

| a | b |
| --- | ---: |
| 1 | 2 |
| 3 | 4 |

| second | table |
| --- | --- |
"""


def test_first_table_is_the_header_rule_and_rows() -> None:
    assert first_table(REPORT) == "| a | b |\n| --- | ---: |\n| 1 | 2 |\n| 3 | 4 |"
    assert first_table("no table | here\n") is None


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        # markers present: only what is between them changes, other parts' blocks stay
        (
            f"# T\nkept\n{BEGIN}\nold\n{END}\n{OTHER}\n",
            f"# T\nkept\n{BEGIN}\nnew\n{END}\n{OTHER}\n",
        ),
        # no markers: the block is appended, the document kept
        ("# T\nkept\n", f"# T\nkept\n\n{BEGIN}\nnew\n{END}\n"),
    ],
)
def test_replace_block_keeps_the_hand_written_text(document: str, expected: str) -> None:
    assert replace_block(document, "part", "new\n") == expected
