"""The built sdist and wheel hold what dtprofile needs at run time (.ci/wheel).

Usage: python .ci/check_dist.py SOURCE_TREE DIST_DIR. Exits non-zero, naming what is
missing or wrong, else prints what the wheel holds beyond Python modules.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path


def _project_version(pyproject: Path) -> str:
    """pyproject.toml's [project] version (tomllib is 3.11+)."""
    table = None
    for line in pyproject.read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            table = line.strip()
        elif table == "[project]" and (m := re.match(r'version\s*=\s*"([^"]+)"', line)):
            return m[1]
    raise SystemExit(f"{pyproject}: no [project] version")


def main(source: Path, dist: Path) -> list[str]:
    problems: list[str] = []
    version = _project_version(source / "pyproject.toml")
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if [w.name for w in wheels] != [f"dtprofile-{version}-py3-none-any.whl"] or [s.name for s in sdists] != [
        f"dtprofile-{version}.tar.gz"
    ]:
        return [f"expected one wheel and one sdist of version {version}, found {[p.name for p in dist.iterdir()]}"]

    # What the package is made of in the source tree: the wheel must hold each file.
    data = {"dtprofile/py.typed": source / "dtprofile" / "py.typed"}
    data.update(
        {
            f"dtprofile/dashboard/static/{p.name}": p
            for p in sorted((source / "dtprofile" / "dashboard" / "static").iterdir())
            if p.is_file()
        }
    )
    if not any(name.startswith("dtprofile/dashboard/static/") for name in data):
        problems.append("the source tree has no dtprofile/dashboard/static files")
    modules = {
        f"dtprofile/{p.relative_to(source / 'dtprofile').as_posix()}"
        for p in (source / "dtprofile").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    modules |= {f"dtprofile/integrations/{p.name}" for p in (source / "integrations").glob("*.py")}

    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        for name, path in data.items():
            if name not in names:
                problems.append(f"wheel: {name} missing")
            elif whl.read(name) != path.read_bytes():
                problems.append(f"wheel: {name} differs from the source tree's")
        problems += [f"wheel: {name} missing" for name in sorted(modules - names)]
        info = f"dtprofile-{version}.dist-info"
        strays = sorted(n for n in names if n.split("/")[0] not in ("dtprofile", info))
        problems += [f"wheel: {name} is neither the package nor its metadata" for name in strays]
        entry_points = whl.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
        for needed in (
            "[console_scripts]\ndtprofile = dtprofile.cli:main",
            "[tensorboard_plugins]\ndtprofile = dtprofile.dashboard.plugin:DTProfilePlugin",
        ):
            if needed not in entry_points:
                problems.append(f"wheel: entry point missing: {needed!r}")
        listed = sorted(n for n in names if not n.endswith(".py"))

    with tarfile.open(sdists[0]) as sdist:
        names = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
        needed = {"pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", *data}
        problems += [f"sdist: {name} missing" for name in sorted(needed - names)]
        problems += [
            f"sdist: {name} missing"
            for name in sorted(m.replace("dtprofile/integrations/", "integrations/") for m in modules)
            if name not in names
        ]

    if problems:
        return problems
    print(f"{wheels[0].name}: {len(modules)} modules, and:")
    for name in listed:
        print(f"  {name}")
    print(f"{sdists[0].name}: builds, holds the same package data")
    return []


if __name__ == "__main__":
    found = main(Path(sys.argv[1]), Path(sys.argv[2]))
    for problem in found:
        print(f"check_dist: {problem}", file=sys.stderr)
    sys.exit(1 if found else 0)
