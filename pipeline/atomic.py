"""Atomic file replacement: write a hidden temp file, flush, fsync, rename, fsync the directory.

A reader (or a resumed job) sees either the old file or the complete new one, never a part.
Temp names are ".<final name>.tmp-<pid>"; a job removes stale ones (from a crash) when it starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO

TEMP_MARKER = ".tmp-"


def temp_path(final_path: str) -> str:
    head, name = os.path.split(final_path)
    return os.path.join(head, f".{name}{TEMP_MARKER}{os.getpid()}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARKER in name


def write_atomically(final_path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call write(file) on a temp file, then make it `final_path` in one rename."""
    tmp = temp_path(final_path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final_path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, "", tmp):
            # a write or fsync that failed (a full disk) names no file, a rename the temp file:
            # name the one it was for
            raise OSError(exc.errno, exc.strerror or str(exc), final_path) from exc
        raise
    fsync_dir(os.path.dirname(final_path) or ".")


def write_bytes_atomically(final_path: str, data: bytes) -> None:
    def write(f: BinaryIO) -> None:
        f.write(data)

    write_atomically(final_path, write)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: str) -> list[str]:
    """Remove temp files left by a crashed job; return their names."""
    stale = sorted(n for n in os.listdir(directory) if is_temp_name(n))
    for name in stale:
        os.remove(os.path.join(directory, name))
    return stale
