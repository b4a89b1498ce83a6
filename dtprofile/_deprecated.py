"""One warning for each compatibility module that still re-exports an old path.

The eleven top-level modules (``dtprofile.comm``, ``.fsdp``, ``.recorder``, ``.timing``,
``.background``, ``.plots``, ``.compare``, ``.model``, ``.advice``, ``.report``,
``.tensorboard``) name the rooms the code lived in before it moved to ``capture/``,
``analysis/``, ``render/`` and ``sinks/``. Each warns once, when imported, and names where
its names live now; they go in the release after this one (CHANGELOG.md). Nothing inside
the package imports them.
"""

from __future__ import annotations

import warnings

__all__ = ["moved"]


def moved(old: str, new: str) -> None:
    """Warn that module ``old`` is deprecated in favour of ``new``.

    Called from the old module's body: ``stacklevel=3`` points the warning at the user's
    import (the import machinery's frames are skipped), so that Python's default filters
    show it where the user's own code imported the old path.

    Args:
        old: The deprecated module, e.g. ``"dtprofile.model"``.
        new: Where its names live now, e.g. ``"dtprofile.analysis"``.
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: import from {new}",
        DeprecationWarning,
        stacklevel=3,
    )
