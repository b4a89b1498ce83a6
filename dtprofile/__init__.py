"""dtprofile: why adding GPUs does not make your training proportionally faster.

Measures, per optimizer step and per rank, compute (T_C), gradient communication and
data wait (T_O), and turns them into the overhead ratio R_O = T_O / T_C, Amdahl
projections for other GPU counts, and concrete advice.

>>> import dtprofile
>>> round(dtprofile.alpha(0.25, 4), 3)
0.625
"""

from __future__ import annotations

import os as _os
import re as _re
import typing as _typing
from importlib.util import find_spec as _find_spec


def _own_version() -> str:
    """This code's version, written in one place: pyproject.toml's ``version``.

    Installed, it is the installed distribution's (``importlib.metadata``). Run from a
    source checkout (an editable install, PYTHONPATH, the tests), it is read from the
    checkout's pyproject.toml: an editable install's metadata keeps the version it was
    installed at, and the summaries this code writes carry its own.
    """
    pyproject = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, encoding="utf-8") as fh:
            table, fields = None, {}
            for line in fh:  # the [project] table's name and version (tomllib is 3.11+)
                if line.startswith("["):
                    table = line.strip()
                elif table == "[project]" and (field := _re.match(r'(name|version)\s*=\s*"([^"]+)"', line)):
                    fields[field[1]] = field[2]
        if fields.get("name") == "dtprofile" and fields.get("version"):
            return fields["version"]
    except OSError:
        pass  # installed: no pyproject.toml beside the package
    from importlib import metadata

    try:
        return metadata.version("dtprofile")
    except metadata.PackageNotFoundError:  # neither a checkout nor installed (a copied folder)
        return "0+unknown"


__version__ = _own_version()

# Installed, ``integrations/`` is the subpackage dtprofile.integrations (pyproject maps it).
# Run from a source checkout (PYTHONPATH, tests from the repository root, a compat-mode
# editable install) it sits beside this folder: load it from there, as that subpackage.
_here = _os.path.dirname(_os.path.abspath(__file__))
_beside = _os.path.join(_os.path.dirname(_here), "integrations")
if not _os.path.isdir(_os.path.join(_here, "integrations")) and _os.path.isfile(_os.path.join(_beside, "__init__.py")):
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location(
        f"{__name__}.integrations", _os.path.join(_beside, "__init__.py"), submodule_search_locations=[_beside]
    )
    if _spec is not None and _spec.loader is not None:  # (always, for a file: this tells mypy)
        _sys.modules[_spec.name] = _util.module_from_spec(_spec)
        _spec.loader.exec_module(_sys.modules[_spec.name])

from .analysis.compare import compare_summaries
from .analysis.perf_model import (
    alpha,
    bandwidth_needed,
    min_parameter_servers,
    parameter_server_seconds,
    parse_bandwidth,
    projected_speedup,
    ring_allreduce_seconds,
    two_level_allreduce_seconds,
)
from .capture.ddp import TimedHook, timed_hook
from .integrations.torch import Profile, profile
from .options import Options
from .summary import Report

__all__ = [
    "__version__",
    "profile",
    "Profile",
    "Report",
    "Options",
    "timed_hook",
    "TimedHook",
    "alpha",
    "projected_speedup",
    "ring_allreduce_seconds",
    "two_level_allreduce_seconds",
    "parameter_server_seconds",
    "min_parameter_servers",
    "bandwidth_needed",
    "parse_bandwidth",
    "compare_summaries",
]
# ``from dtprofile import *`` takes the callback only where Lightning is installed (asking
# for it otherwise raises an ImportError that says what to install).
if any(_find_spec(m) is not None for m in ("pytorch_lightning", "lightning")):
    __all__.append("DTProfileCallback")
if _find_spec("transformers") is not None:
    __all__.append("DTProfileTrainerCallback")


def __getattr__(name: str) -> _typing.Any:
    # Lightning and Transformers are imported only when their callback is asked for.
    if name == "DTProfileCallback":
        from .integrations.lightning import DTProfileCallback

        return DTProfileCallback
    if name == "DTProfileTrainerCallback":
        from .integrations.transformers import DTProfileTrainerCallback

        return DTProfileTrainerCallback
    raise AttributeError(f"module 'dtprofile' has no attribute {name!r}")
