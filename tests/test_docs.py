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
    from dtprofile.model import project_summary

    text = (REPO / "docs" / "summary.md").read_text()
    comment = text.split('"reference_step_ms"', 1)[1].split('"R_O"', 1)[0]  # up to the next key
    assert "G = 1" in comment and "measured G" not in comment, comment
    # What the code computes: the modelled step at G = 1, not the measured step.
    s = {"world_size": 2, "grad_bytes": 50331648, "busbw_GBps": 0.8,
         "per_step_ms": {"step": 95.0, "data_wait": 1.0, "forward": 20.0, "backward": 50.0,
                         "optimizer": 3.0, "comm_total": 60.0, "comm_exposed": 32.0,
                         "compute": 62.0, "overhead": 33.0}}
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
    code = (f"import sys; sys.path.append({site_packages!r}); "
            "import dtprofile, dtprofile.integrations.torch as t; print(t.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tree, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tree / "integrations" / "torch.py")
