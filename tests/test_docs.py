"""The documentation's tables are well formed: every row has its header's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _cells(line: str) -> int:
    # Split on pipes that are not escaped or inside `code`.
    count, in_code, prev = 0, False, ""
    for ch in line.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        elif ch == "|" and not in_code and prev != "\\":
            count += 1
        prev = ch
    return count + 1


def _tables(text: str):
    table: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            table.append((number, line))
        elif table:
            yield table
            table = []
    if table:
        yield table


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_markdown_tables_are_rectangular(path):
    for table in _tables(path.read_text()):
        (first, header), rest = table[0], table[1:]
        width = _cells(header)
        assert rest and set(rest[0][1].replace("|", "").strip()) <= set("-: "), f"{path.name}:{first}: no separator row"
        for number, line in rest:
            assert _cells(line) == width, f"{path.name}:{number}: {_cells(line)} cells, header has {width}"
