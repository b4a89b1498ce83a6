"""The documentation's tables are well formed: every row has its header's columns."""

from __future__ import annotations

import os
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


def test_summary_doc_describes_reference_step_as_the_model_at_one_gpu():
    from dtprofile.analysis.projection import project_summary

    text = (REPO / "docs" / "summary.md").read_text()
    comment = text.split('"reference_step_ms"', 1)[1].split('"R_O"', 1)[0]  # up to the next key
    assert "G = 1" in comment and "measured G" not in comment, comment
    # What the code computes: the modelled step at G = 1, not the measured step.
    s = {
        "world_size": 2,
        "grad_bytes": 50331648,
        "busbw_GBps": 0.8,
        "per_step_ms": {
            "step": 95.0,
            "data_wait": 1.0,
            "forward": 20.0,
            "backward": 50.0,
            "optimizer": 3.0,
            "comm_total": 60.0,
            "comm_exposed": 32.0,
            "compute": 62.0,
            "overhead": 33.0,
        },
    }
    p = project_summary(s, gpus=[1, 2])
    assert p["reference_step_ms"] == p["step_ms"][0] != s["per_step_ms"]["step"]


def test_the_source_tree_imports_without_an_install(tmp_path):
    """``integrations/`` sits beside the package in the repository (pyproject maps it to
    dtprofile.integrations): a checkout on sys.path, with no install's import hooks (no
    .pth files: ``-S``), still imports it, from the checkout."""
    import shutil
    import subprocess
    import sys

    tree = tmp_path / "checkout"
    for part in ("dtprofile", "integrations"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    # Where torch is installed, found from this process: under -S a virtualenv's
    # interpreter reports the base installation's site-packages, not the venv's.
    import torch

    site_packages = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    code = (
        f"import sys; sys.path.append({site_packages!r}); "
        "import dtprofile, dtprofile.integrations.torch as t; print(t.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tree / "integrations" / "torch.py")


# --------------------------------------------------------------------------- links and code blocks


def _fenced_blocks(text: str):
    """(info string, first line number, body) of each fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].lstrip()
        if line.startswith("```"):
            info, start, body = line[3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"line {start}: unclosed code block"
            yield info, start, "\n".join(body)
        i += 1


def _prose(text: str) -> str:
    """The text with its fenced code blocks blanked out (links inside them are code)."""
    out, in_block = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            out.append("")
        else:
            out.append("" if in_block else line)
    return "\n".join(out)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    import re

    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in _prose(path.read_text()).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_point_to_files_that_exist(path):
    import re

    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.name}: link to {target}: no such file"
        assert REPO in resolved.parents or resolved == REPO, f"{path.name}: {target} leaves the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{path.name}: link to {target}: no such heading"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_code_blocks_parse(path):
    import ast

    for info, start, body in _fenced_blocks(path.read_text()):
        if info == "python":
            try:
                ast.parse(body)
            except SyntaxError as e:
                pytest.fail(f"{path.name}:{start + (e.lineno or 0)}: {e.msg}")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_dtprofile_commands_in_the_docs_parse(path):
    """Every `dtprofile ...` line of a bash block names a real subcommand and options."""
    import shlex

    from dtprofile.cli import build_parser

    for info, start, body in _fenced_blocks(path.read_text()):
        if info != "bash":
            continue
        lines = body.replace("\\\n", " ").splitlines()  # continuation lines joined
        for offset, line in enumerate(lines, 1):
            for command in line.split("&&"):
                words = shlex.split(command, comments=True)
                if words[:1] != ["dtprofile"]:
                    continue
                try:
                    args = build_parser().parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{path.name}:{start + offset}: {command.strip()!r} does not parse")
                assert args.command, f"{path.name}:{start + offset}: no subcommand"


def test_quick_start_holds_the_two_commands_ci_runs():
    """.ci/run takes the first bash block under "## Quick start", one command a line."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1]
    info, _, body = next(_fenced_blocks(section))
    assert info == "bash"
    assert [line for line in body.splitlines() if line.strip()] == [
        "python -m pip install torch==2.13.0 && python -m pip install -e . && dtprofile demo",
        'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && python -m pytest -q',
    ]


def test_every_docs_page_is_reachable_from_the_readme():
    import re

    linked = {
        (REPO / t.partition("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text())
    }
    for page in sorted((REPO / "docs").glob("*.md")):
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(REPO)}"
