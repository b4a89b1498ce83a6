"""The ranks of a DDP model's process group agree through the job's store, never on the
group itself.

A probe step (:mod:`.probe`) needs the ranks to agree twice: whether the pass it is
about to reduce was a plain one on every rank, and, once reduced, whether every rank
holds the same gradients. A collective on the job's process group would pair with any
collective of the loop's own that a rank is in at that moment (a loss all-reduced for
logging, Lightning's ``sync_dist``, another model's reduction), so those meetings go
through the store that ``init_process_group`` set up: each rank's messages go to the
store's server only (one connection a rank, whatever the world size), and every wait
has a timeout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["StoreAgreement"]


class StoreAgreement:
    """Meetings of one process group's ranks on the store, numbered from 0.

    Args:
        store: the job's store (``torch.distributed``'s default store).
        group_name: the process group's name (keys of different groups never meet).
        size: the group's size: a meeting is complete when this many ranks arrived.
        timeout_s: how long a rank waits for the others at a meeting.

    The meetings are named under a key every rank agreed on (:meth:`name`: the profiler's
    start), so that a later profiler's never meet an earlier one's, even where a rank
    profiled a run the others did not.

    Example:
        >>> agreement = StoreAgreement(store, "0", size=2, timeout_s=60.0)  # doctest: +SKIP
        >>> agreement.name("dtprofile/start/0")  # doctest: +SKIP
        >>> agreement.any_flag("0/shape", flag=False)  # doctest: +SKIP
        False
    """

    def __init__(self, store: Any, group_name: str, size: int, timeout_s: float) -> None:
        self.store = store
        self.size = size
        self.timeout = timedelta(seconds=timeout_s)
        self.group_name = group_name
        self.prefix = f"dtprofile/agree/{group_name}"
        self._previous: str | None = None  # the meeting before this one (its keys go next)

    def name(self, key: str) -> None:
        """Name the meetings from now on under ``key`` (the same on every rank)."""
        self.prefix = f"{key}/agree/{self.group_name}"
        self._previous = None

    def any_flag(self, meeting: str, flag: bool) -> bool | None:
        """Whether any rank raised its flag at ``meeting`` (a name every rank gives in the
        same order); None when some rank did not arrive within the timeout.

        The ranks count themselves in, the flags counted first; the last to arrive
        publishes the count of flags, for which the others wait (a wait the store answers
        as soon as the key is written, not by polling)."""
        key = f"{self.prefix}/{meeting}"
        store = self.store
        try:
            if flag:
                store.add(key + "/flags", 1)
            last = store.add(key + "/n", 1) == self.size
            if last:
                store.set(key + "/go", str(store.add(key + "/flags", 0)))
            store.wait([key + "/go"], self.timeout)
            flags = int(store.get(key + "/go"))
            if last:
                self._clear_earlier(meeting)
            else:
                self._previous = meeting
            return flags > 0
        except Exception:
            return None

    def same_value(self, meeting: str, value: bytes) -> bool | None:
        """Whether every rank gave the same ``value`` at ``meeting``; None when some rank
        did not arrive within the timeout. The first value set stays; every rank compares
        its own with it, then the ranks agree on whether any differed."""
        try:
            first = self.store.compare_set(f"{self.prefix}/{meeting}/value", "", value)
        except Exception:
            return None
        differs = self.any_flag(meeting, bytes(first) != value)
        return None if differs is None else not differs

    def signal(self, name: str) -> None:
        """Say ``name`` happened on this rank (for one other rank's :meth:`wait`)."""
        try:
            self.store.set(f"{self.prefix}/{name}", "1")
        except Exception:
            pass

    def wait(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for another rank's :meth:`signal` of ``name``; whether
        it came."""
        try:
            self.store.wait([f"{self.prefix}/{name}"], timedelta(seconds=timeout_s))
            return True
        except Exception:
            return False

    def forget(self, name: str) -> None:
        """This rank's :meth:`signal` of ``name`` is no longer waited for: its key goes."""
        try:
            self.store.delete_key(f"{self.prefix}/{name}")
        except Exception:
            pass

    def _clear_earlier(self, meeting: str) -> None:
        """The last rank to arrive at ``meeting`` knows that every rank has left the one
        before it: that one's keys go, so that the store stays small however long the run."""
        previous, self._previous = self._previous, meeting
        if previous is None:
            return
        for suffix in _SUFFIXES:
            try:
                self.store.delete_key(f"{self.prefix}/{previous}/{suffix}")
            except Exception:
                return  # (a store that cannot delete keeps them: a few bytes a probe)


_SUFFIXES = ("flags", "n", "go", "value")
