"""Output paths, checked before a run starts: a run that may train for hours must not die at its first save.

`lab.train` and `lab serve` check every path they will write (the checkpoint directory, the JSON log, the
report) before any rank starts, and refuse a bad one in one line that names the flag, the path and why:

    --checkpoint-dir /etc/passwd: not a directory (a file is there)
    --log-json /nonexistent/x.jsonl: its directory /nonexistent does not exist

The checks do what the run will do instead of reading permission bits, which do not bind root (tests and many
containers run as root): a directory is writable if a file can be made in it, which also catches a read-only
mount, /proc and /sys; an existing file is writable if it opens for appending, which leaves it as it was.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def check_output_file(path: str, flag: str) -> None:
    """Refuse a file path the run could not open for writing. Its directory must exist: the run opens the file,
    it does not make directories for it."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if os.path.exists(path):
        _try_write(path, flag, lambda: open(path, "a").close())  # appending nothing leaves the file as it was
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise ValueError(f"{flag} {path}: its directory {parent} does not exist")
    _check_directory(parent, path, flag)


def check_output_dir(path: str, flag: str) -> None:
    """Refuse a directory the run could not create (with its parents, as `os.makedirs` does) or write into."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: not a directory (a file is there)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the nearest ancestor that exists: the run creates the rest in it
        existing = os.path.dirname(existing)
    _check_directory(existing, path, flag)


def _check_directory(directory: str, path: str, flag: str) -> None:
    """`directory` (`path` itself or an ancestor of it) must be a directory a file can be created in."""
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {path}: {directory} is not a directory")

    def probe() -> None:
        handle, name = tempfile.mkstemp(prefix=".lab-write-check-", dir=directory)
        os.close(handle)
        os.unlink(name)

    _try_write(path, flag, probe, f" (no file can be created in {directory})" if directory != path else "")


def _try_write(path: str, flag: str, attempt: Callable[[], None], where: str = "") -> None:
    try:
        attempt()
    except OSError as error:
        raise ValueError(f"{flag} {path}: not writable{where}: {error.strerror or error}") from None
