"""One public surface: the names a user imports are listed once and documented; the
compatibility modules warn, name the new path, and nothing inside the package imports them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dtprofile

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = (REPO / "dtprofile", REPO / "integrations")

#: The deprecated top-level modules and where their names live now.
COMPAT = {
    "comm": "dtprofile.capture.ddp",
    "fsdp": "dtprofile.capture.fsdp",
    "recorder": "dtprofile.capture.records",
    "timing": "dtprofile.capture.clocks",
    "background": "dtprofile.sinks.background",
    "plots": "dtprofile.sinks.plots",
    "compare": "dtprofile.analysis.compare",
    "model": "dtprofile.analysis",
    "advice": "dtprofile.analysis.advice",
    "report": "dtprofile.summary",
    "tensorboard": "dtprofile.sinks.tensorboard",
}


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (modules imported once warn once), from the repo."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_each_compatibility_module_warns_and_names_the_new_path():
    code = (
        "import importlib, json, warnings\n"
        f"out = {{}}\n"
        f"for name in {sorted(COMPAT)!r}:\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        exec('import dtprofile.' + name)  # (a user's import statement)\n"
        "    out[name] = [(w.category.__name__, str(w.message), w.filename) for w in seen\n"
        "                 if issubclass(w.category, DeprecationWarning) and 'dtprofile.' + name in str(w.message)]\n"
        "print(json.dumps(out))\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    for name, new in COMPAT.items():
        assert len(seen[name]) == 1, (name, seen[name])
        _, message, filename = seen[name][0]
        assert new in message and "removed in the next release" in message, message
        assert filename == "<string>", (name, filename)  # the user's import, not ours


def test_nothing_inside_the_package_imports_a_compatibility_module():
    """Neither at import (every module of the package, warnings as errors) nor in the source."""
    done = _fresh(
        "import importlib, pkgutil, warnings\n"
        "warnings.filterwarnings('error', category=DeprecationWarning, module='dtprofile')\n"
        "warnings.filterwarnings('error', message='dtprofile\\\\.', category=DeprecationWarning)\n"
        "import dtprofile\n"
        f"old = {sorted(COMPAT)!r}\n"
        "for m in pkgutil.walk_packages(dtprofile.__path__, 'dtprofile.'):\n"
        "    if m.name.split('.')[1] in old or m.name.startswith('dtprofile.dashboard.static'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as e:  # an optional framework not installed here\n"
        "        if 'dtprofile' in str(e.name or ''):\n"
        "            raise\n"
        "print('ok')\n"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    offenders = []
    for folder in PACKAGE_DIRS:
        for path in folder.rglob("*.py"):
            if path.parent == REPO / "dtprofile" and path.stem in COMPAT:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    top = (node.module or "").split(".")
                    absolute = node.level == 0 and top[0] == "dtprofile" and len(top) > 1 and top[1] in COMPAT
                    # from . import model / from .model import x, at the package's top level
                    relative = (
                        node.level == 1
                        and path.parent == REPO / "dtprofile"
                        and (top[0] in COMPAT or (not node.module and any(a.name in COMPAT for a in node.names)))
                    )
                    up = node.level == 2 and path.parent.parent == REPO / "dtprofile" and top[0] in COMPAT
                    if absolute or relative or up:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    offenders += [
                        f"{path.relative_to(REPO)}:{node.lineno}"
                        for a in node.names
                        if a.name.split(".")[:2] in [["dtprofile", m] for m in COMPAT]
                    ]
    assert not offenders, offenders


def test_the_changelog_announces_each_removal():
    text = (REPO / "CHANGELOG.md").read_text()
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    deprecated = unreleased.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    for name, new in COMPAT.items():
        assert f"`dtprofile.{name}`" in deprecated and new in deprecated, name


@pytest.mark.parametrize(
    "module",
    [
        "dtprofile",
        "dtprofile.integrations.torch",
        "dtprofile.integrations.lightning",
        "dtprofile.integrations.transformers",
    ],
)
def test_every_public_name_resolves_and_is_listed_in_the_api_page(module):
    """``__all__`` is the list of what a user imports: each name is there, and
    docs/api.md lists it in the module's own section or table row."""
    if module.endswith(("lightning", "transformers")):
        pytest.importorskip("pytorch_lightning" if module.endswith("lightning") else "transformers")
    mod = __import__(module, fromlist=["__all__"])
    api = (REPO / "docs" / "api.md").read_text()
    where = (
        api.split("## The integrations", 1)[0]
        if module == "dtprofile"
        else next(line for line in api.splitlines() if line.startswith(f"| `{module}` |"))
    )
    for name in mod.__all__:
        assert getattr(mod, name) is not None, (module, name)
        assert f"`{name}`" in where or f"`{name}(" in where, (module, name)


def test_the_top_level_names_are_the_documented_surface():
    """The package's top level exports its surface and nothing that merely passed through."""
    public = {n for n in vars(dtprofile) if not n.startswith("_")} - {"annotations"}  # (from __future__)
    subpackages = {"analysis", "capture", "dashboard", "integrations", "render", "sinks"}
    modules = {n for n in public if type(getattr(dtprofile, n)).__name__ == "module"}
    assert set(dtprofile.__all__) - {"DTProfileCallback", "DTProfileTrainerCallback", "__version__"} <= public
    stray = public - set(dtprofile.__all__) - modules - subpackages
    assert not stray, stray
