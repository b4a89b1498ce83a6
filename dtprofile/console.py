"""Console output from rank 0 only.

On a multi-rank run every process would print the same warning; dtprofile's warnings
appear once, from rank 0. The other ranks log the message at INFO level instead (it
stays available with ``logging.basicConfig(level=logging.INFO)``).

>>> rank_of_process()
0
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["rank_of_process", "warn"]

log = logging.getLogger("dtprofile")


def rank_of_process() -> int:
    """The global rank of this process: torch.distributed's, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def warn(message: str, stacklevel: int = 2, here: bool | None = None) -> None:
    """A ``RuntimeWarning`` on rank 0; an INFO log record on every other rank.

    ``here``: this process is the one that shows it (True) or not (False), whatever its
    rank: for what rank 0 may not take part in (a profile started on some ranks only).

    Never raises: where warnings are errors (``python -W error``, pytest's
    ``filterwarnings = error``) the message is logged at WARNING level instead, so that a
    warning from inside a training step's hook cannot stop the training.
    """
    if not (rank_of_process() == 0 if here is None else here):
        log.info("%s", message)
        return
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    except Exception:
        log.warning("%s", message)
