"""Sink work off the training thread.

Writing an interval to TensorBoard (scalars, Markdown, now and then images) takes
milliseconds to a fifth of a second; on the training thread that would be a stall every
``every_n_steps``. :class:`BackgroundSink` hands each interval to one daemon thread. If
the thread is still busy when the next interval arrives, the newer summary replaces the
one waiting (the latest figures are what matter); memory holds at most one pending
summary.

>>> class Printer:
...     def __init__(self): self.seen = []
...     def log(self, summary, step): self.seen.append(step)
>>> sink = Printer(); bg = BackgroundSink(sink, on_error=print)
>>> bg.submit({}, 50)
>>> bg.stop(timeout_s=5.0)
True
>>> sink.seen
[50]
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["BackgroundSink"]


class BackgroundSink:
    """Calls ``sink.log(summary, step)`` on a daemon thread, newest-wins."""

    def __init__(self, sink: Any, on_error: Callable[[BaseException], None]) -> None:
        self._sink = sink
        self._on_error = on_error
        self._cond = threading.Condition()
        self._pending: tuple[dict, int] | None = None
        self._busy = False
        self._stopping = False
        self._failed = False
        self._thread: threading.Thread | None = None
        self.replaced = 0  # intervals superseded before they were written

    def submit(self, summary: dict, step: int) -> None:
        """Queue an interval for writing; returns at once.

        Args:
            summary: The interval's summary, handed to ``sink.log`` as it is.
            step: The global optimizer step it is logged at.
        """
        with self._cond:
            if self._failed or self._stopping:
                return
            if self._pending is not None:
                self.replaced += 1
            self._pending = (summary, step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dtprofile-sink", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:
                    return
                item, self._pending = self._pending, None
                self._busy = True
            try:
                self._sink.log(*item)
            except Exception as exc:  # the sink part is switched off; training goes on
                with self._cond:
                    self._failed = True
                    self._pending = None
                self._on_error(exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if self._failed:
                return

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted is written.

        Args:
            timeout_s: The longest wait, in seconds.

        Returns:
            False when the time ran out first.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout=timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Write what is pending, then end the thread.

        Args:
            timeout_s: The longest wait for each of the two, in seconds.

        Returns:
            False when the time ran out first (the thread is a daemon: it ends with the
            process).
        """
        done = self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            done = done and not self._thread.is_alive()
        return done
