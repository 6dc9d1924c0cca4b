"""Output files of the command line (``--json``, ``--plot``, ``--dump``): refused up front when they cannot
be written, written after the run with a failure reported as one line (the caller exits 2)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable

from canary_jax.cli.args import UsageError


def check_out_path(flag: str, path: str | None, suffix: str | None = None) -> None:
    """Refuses an output path that cannot be written, before any work is done.

    Opens the path for append and closes it again (a file that did not exist is removed again), so a
    read-only file, a missing or read-only directory or a path under /proc fails now, not after the run.

    Args:
      flag: the option that named the path (``"--json"``), quoted in the message.
      path: the path, or None (nothing to check).
      suffix: the ending the path must have (``".png"``), or None.

    Raises:
      UsageError: the path is empty, a directory, in a missing or read-only directory, has the wrong suffix,
        is a kernel pseudo-file or cannot be opened for writing.
    """
    if path is None:
        return
    if not path or os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory or empty; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path!r}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path!r}: directory {parent} is not writable")
    if suffix and not path.lower().endswith(suffix):
        raise UsageError(f"{flag} {path!r} must end in {suffix}")
    if os.path.realpath(path).startswith(("/proc/", "/sys/")):  # opens fine as root, then fails on write
        raise UsageError(f"{flag} {path!r} is not writable: a kernel pseudo-file, not an output file")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"{flag} {path!r}: {e.strerror or e}") from None
    try:
        if st is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.close(fd)
            os.unlink(path)
        elif not stat.S_ISFIFO(st.st_mode):  # a FIFO would block until a reader comes
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            os.close(fd)
    except FileExistsError:  # created by someone else meanwhile: theirs, leave it
        pass
    except OSError as e:
        raise UsageError(f"{flag} {path!r} is not writable: {e.strerror or e}") from None


def write_output(flag: str, path: str, write: Callable[[str], None], errors: list[str]) -> None:
    """Runs ``write(path)``; a failure (disk full, /dev/full, permissions) becomes one line in ``errors``."""
    try:
        write(path)
    except OSError as e:
        errors.append(f"{flag} {path!r}: cannot write: {e.strerror or e}")


def write_json(obj) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)

    return write
