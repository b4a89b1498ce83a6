"""What handing a batch over from a DataLoader worker costs this machine, measured once.

A worker process collates each batch into shared memory (in a worker, torch's
``default_collate`` allocates the batch's storage with ``_new_shared``), and the training
process frees that memory once it is done with the batch. Both are the kernel's work on
every 4 KiB page (a fault and a zeroed page for each one written; unmapping and freeing
them), whose cost differs between machines: a 19 MB batch cost a worker about 15 ms more
than the main process on one 2-core VM, and 6.6 ms on another. A run whose main process
loads its batches shows neither, so the loader advice measures them here, on this
machine, for a batch of the run's size.

The probe writes a buffer of the batch's bytes (at most :data:`PROBE_MAX_BYTES`, scaled
to the batch) into reused heap memory, as the main process's own collate does, and into
fresh shared memory, as a worker's does, then frees the shared memory; the CPU time of
this thread (``time.thread_time``: the page faults' kernel time included) for each, the
median of :data:`PROBE_REPEATS`. About 40 ms for a batch of 8 MiB or more, once per run,
on the thread that builds a summary (the intervals' worker; the final summary's caller).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["HandoffCost", "measure_handoff", "HandoffProbe", "PROBE_MIN_BYTES", "PROBE_MAX_BYTES", "PROBE_REPEATS"]

log = logging.getLogger(__name__)

#: Batches smaller than this are not probed: their hand-over is the fixed per-batch cost
#: (``WORKER_SEND_MS``, ``WORKER_HANDOFF_MS`` in :mod:`dtprofile.analysis.sizing`).
PROBE_MIN_BYTES = 1 << 20
#: The largest buffer probed; a larger batch's costs are scaled from it (the work is per
#: page). Three buffers this size exist while the probe runs.
PROBE_MAX_BYTES = 8 << 20
#: Times each cost is measured; the medians count.
PROBE_REPEATS = 5


@dataclass(frozen=True)
class HandoffCost:
    """A batch's hand-over from a worker process, in CPU milliseconds.

    Attributes:
        batch_bytes: The batch's bytes the costs are for.
        copy_ms: A worker's writing of the batch into fresh shared memory, beyond writing
            it into the reused heap memory a main-process collate writes into.
        release_ms: Freeing that shared memory (the training process, once done with
            the batch).
    """

    batch_bytes: int
    copy_ms: float
    release_ms: float


def measure_handoff(batch_bytes: int, max_bytes: int = PROBE_MAX_BYTES, repeats: int = PROBE_REPEATS) -> HandoffCost:
    """Measure :class:`HandoffCost` for a batch of ``batch_bytes`` on this machine.

    Args:
        batch_bytes: The batch's bytes (> 0).
        max_bytes: The largest buffer written; a larger batch's costs are scaled.
        repeats: Measurements of each cost; the medians count.

    Returns:
        The costs for ``batch_bytes``.

    Example:
        >>> cost = measure_handoff(2 << 20, repeats=1)
        >>> cost.batch_bytes, cost.copy_ms >= 0.0, cost.release_ms >= 0.0
        (2097152, True, True)
    """
    if batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be > 0, got {batch_bytes!r}")
    nbytes = int(min(batch_bytes, max_bytes))
    clock = time.thread_time
    # Copied by numpy, on this thread alone: a worker runs torch on one thread, and
    # torch's own copy would spread the page faults over threads this clock does not see.
    # (A batch past glibc's largest reused block, 32 MiB, faults fresh pages in the main
    # process too, which the reused buffer here leaves out: the copy comes out high.)
    source = np.ones(nbytes, dtype=np.uint8)
    heap = np.empty(nbytes, dtype=np.uint8)
    np.copyto(heap, source)  # (its pages now mapped: a main-process collate's, reused batch after batch)
    heap_s, shared_s, release_s = [], [], []
    for _ in range(max(1, repeats)):
        c0 = clock()
        np.copyto(heap, source)
        c1 = clock()
        storage = torch.UntypedStorage._new_shared(nbytes)  # (what default_collate allocates in a worker)
        shared = torch.empty(0, dtype=torch.uint8).set_(storage)
        np.copyto(shared.numpy(), source)
        c2 = clock()
        del shared, storage  # (the last references: the memory is unmapped and freed here)
        c3 = clock()
        heap_s.append(c1 - c0)
        shared_s.append(c2 - c1)
        release_s.append(c3 - c2)
    # Medians: one write in several may take twice the others (the kernel's own work on
    # its free pages), and a worker writes batch after batch.
    copy_s = max(0.0, statistics.median(shared_s) - statistics.median(heap_s))
    scale = batch_bytes / nbytes * 1e3
    return HandoffCost(
        batch_bytes=int(batch_bytes), copy_ms=copy_s * scale, release_ms=statistics.median(release_s) * scale
    )


class HandoffProbe:
    """:func:`measure_handoff` once per run, for the run's batch, where it matters: the
    main process loads (a run with workers has these costs in its measured times) and a
    batch is at least :data:`PROBE_MIN_BYTES`. Thread-safe; never raises (a failed probe
    warns in the log and the advice uses its fixed rates).

    Args:
        measure: The measuring function (a fake in tests).
    """

    def __init__(self, measure: Callable[[int], HandoffCost] = measure_handoff) -> None:
        self._measure = measure
        self._lock = threading.Lock()
        self._cost: HandoffCost | None = None
        self._failed = False

    def cost(self, batch_bytes: int | None, num_workers: int | None) -> HandoffCost | None:
        """The costs for a batch of ``batch_bytes`` (measured on the first call that needs
        them); None where not needed or not measurable.

        Args:
            batch_bytes: The run's batch bytes (None: no batch seen).
            num_workers: The loader's workers (0 or None: the main process loads).

        Returns:
            The :class:`HandoffCost` for ``batch_bytes``, or None.
        """
        if num_workers or batch_bytes is None or batch_bytes < PROBE_MIN_BYTES:
            return None
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return None  # (the other strategy's shared memory would start torch's manager process here)
        with self._lock:  # (the intervals' worker and a final summary may ask at once)
            if self._cost is None and not self._failed:
                try:
                    self._cost = self._measure(int(batch_bytes))
                except Exception as exc:  # (no shared memory here: the fixed rates stand)
                    self._failed = True
                    log.warning("dtprofile: could not measure a loader worker's hand-over of a batch: %r", exc)
            cost = self._cost
        if cost is None or cost.batch_bytes == batch_bytes:
            return cost
        # (a later batch of another size: the same per-byte costs)
        scale = batch_bytes / cost.batch_bytes
        return HandoffCost(int(batch_bytes), cost.copy_ms * scale, cost.release_ms * scale)
