"""The summary file: written atomically with room set aside for it, read back and checked.

A run's summary (:mod:`dtprofile.summary` builds it) lands in its logdir as
:data:`SUMMARY_NAME`. :func:`write_summary` replaces the file whole or not at all;
:func:`reserve_summary_space` holds room for it while the run fills the disk with event
files, and :func:`write_summary_with_reserve` gives that room back when it is needed.
:func:`load_summary` reads a file back and refuses one of another schema than
:data:`SCHEMA` with a one-line :class:`SummaryError`.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from typing import Any

__all__ = [
    "SCHEMA",
    "SUMMARY_NAME",
    "SUMMARY_RESERVE_BYTES",
    "SummaryError",
    "load_summary",
    "reserve_summary_space",
    "write_summary",
    "write_summary_with_reserve",
]

#: The ``schema`` value of every summary this dtprofile writes, and the only one it reads.
SCHEMA = "dtprofile.summary/1"
#: The summary's file name in a run's log directory.
SUMMARY_NAME = "dtprofile_summary.json"


#: Bytes set aside in the logdir while a run profiles, for its final summary: a disk
#: filled by the event files (or anything else) still takes the summary, which is what
#: ``dtprofile report`` reads. A 64-rank summary is about 100 KB.
SUMMARY_RESERVE_BYTES = 512 * 1024
_RESERVE_NAME = ".dtprofile_summary.{pid}.reserve"  # one per process: runs may share a logdir


def reserve_summary_space(logdir: str) -> str | None:
    """Set :data:`SUMMARY_RESERVE_BYTES` aside in ``logdir``, in a hidden file.

    Args:
        logdir: The run's log directory (created when missing).

    Returns:
        The reserve's path, for :func:`write_summary_with_reserve`; None when the disk has
        not even that much room (nothing is left behind then).

    Example:
        >>> import tempfile
        >>> logdir = tempfile.mkdtemp()
        >>> reserve = reserve_summary_space(logdir)
        >>> os.path.getsize(reserve) == SUMMARY_RESERVE_BYTES
        True
        >>> write_summary_with_reserve({"schema": SCHEMA}, os.path.join(logdir, "s.json"), reserve)
        >>> sorted(os.listdir(logdir))
        ['s.json']
    """
    path = os.path.join(logdir, _RESERVE_NAME.format(pid=os.getpid()))
    try:
        os.makedirs(logdir, exist_ok=True)
        with open(path, "wb") as fh:
            try:
                os.posix_fallocate(fh.fileno(), 0, SUMMARY_RESERVE_BYTES)
            except (AttributeError, OSError):  # no fallocate here (another OS, some filesystems)
                fh.write(b"\0" * SUMMARY_RESERVE_BYTES)
                fh.flush()
                os.fsync(fh.fileno())
    except OSError:
        _remove(path)
        return None
    return path


def write_summary_with_reserve(summary: dict[str, Any], path: str, reserve: str | None) -> None:
    """:func:`write_summary`, giving back the reserve's space when the disk is full.

    Args:
        summary: The summary dict.
        path: Where it goes.
        reserve: :func:`reserve_summary_space`'s path, or None. It is removed in any case.

    Raises:
        OSError: The write failed, with the reserve's room too.

    Example:
        See :func:`reserve_summary_space`.
    """
    try:
        write_summary(summary, path)
    except OSError as exc:
        if reserve is None or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        _remove(reserve)
        write_summary(summary, path)
    finally:
        if reserve is not None:
            _remove(reserve)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write a summary as JSON, atomically: a temp file in the same directory, fsync, rename.

    A reader never sees half a file, and a failed write leaves the previous one in place.

    Args:
        summary: The summary dict; numpy scalars, tuples and sets are written as numbers
            and lists. NaN and infinities are refused (JSON has neither).
        path: The file; its directory is created when missing.

    Raises:
        OSError: The file could not be written (nothing is left behind).
        ValueError: A NaN or an infinity in ``summary``.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "dtprofile_summary.json")
        >>> write_summary({"schema": SCHEMA, "sizes": (1, 2)}, path)
        >>> load_summary(path)
        {'schema': 'dtprofile.summary/1', 'sizes': [1, 2]}
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dtprofile_summary.", suffix=".tmp", dir=directory)
    try:
        # mkstemp's file is private (0600); a summary is read as the event files are
        # (TensorBoard or the CLI under another account): the mode a new file gets.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as fh:
            json.dump(summary, fh, indent=2, allow_nan=False, default=_json_default)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (``an array``, not ``a list``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


class SummaryError(ValueError):
    """A file that is not a summary this dtprofile reads; the message is one line that
    names the file."""


def load_summary(path: str) -> dict[str, Any]:
    """Read a summary file and check that it is one this dtprofile reads.

    Args:
        path: A ``dtprofile_summary.json``.

    Returns:
        The summary dict.

    Raises:
        SummaryError: (a ValueError) not JSON, not UTF-8 text, not a summary, or a summary
            of another schema than :data:`SCHEMA`: one line naming the file (and the
            schema it found).
        OSError: The file cannot be read.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "old.json")
        >>> with open(path, "w") as fh:
        ...     _ = fh.write('{"schema": "dtprofile.summary/0"}')
        >>> load_summary(path)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        dtprofile.summary_file.SummaryError: .../old.json: summary schema "dtprofile.summary/0",
        this dtprofile reads "dtprofile.summary/1"
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        # json's own layout ("msg: line L column C"): some messages end in "at" already.
        raise SummaryError(f"{path}: not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError:
        raise SummaryError(f"{path}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise SummaryError(
            f'{path}: not a dtprofile summary ({_json_kind(data)}, expected an object with "schema": "{SCHEMA}")'
        )
    if "schema" not in data:
        raise SummaryError(f'{path}: not a dtprofile summary (no "schema"; expected "schema": "{SCHEMA}")')
    found = data["schema"]
    if found == SCHEMA:
        return data
    # Another version's summary may name the same keys with other meanings: refused, not
    # read as if it were this one.
    if str(found).startswith(SCHEMA.split("/")[0] + "/"):
        raise SummaryError(f'{path}: summary schema {json.dumps(found)}, this dtprofile reads "{SCHEMA}"')
    raise SummaryError(f'{path}: not a dtprofile summary ("schema": {json.dumps(found)}; expected "{SCHEMA}")')
