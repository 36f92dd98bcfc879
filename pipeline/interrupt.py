"""Stopping a job on SIGINT/SIGTERM: a flag the job checks between stages and after each engine
step (a second signal stops it at once), and what to tell the user (how to resume)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class JobInterrupted(Exception):
    """SIGINT/SIGTERM: the shard in flight was abandoned; committed shards are kept."""

    def __init__(self, signum: int, overwrite: bool = False) -> None:
        super().__init__(f"interrupted; {rerun_hint(overwrite)}")
        self.signum = signum


def rerun_hint(overwrite: bool) -> str:
    """How to resume: the same command, less --overwrite (which would start over)."""
    if overwrite:
        return "rerun the same command without --overwrite to resume (with it, the job starts over)"
    return "rerun the same command to resume"


class StopFlag:
    """Set by SIGINT/SIGTERM; the job checks it between stages and after each engine step."""

    def __init__(self, overwrite: bool) -> None:
        self.signum: int | None = None
        self.overwrite = overwrite
        self._shielded = False

    def check(self) -> None:
        if self.signum is not None:
            raise JobInterrupted(self.signum, self.overwrite)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and not self._shielded:
            raise JobInterrupted(signum, self.overwrite)  # a second signal: stop now
        self.signum = self.signum or signum

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """No signal stops what runs inside (the last save of the manifest: a second Ctrl-C
        there threw away its temporary file, and with it shards already written)."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False


@contextmanager
def stop_on_signals(overwrite: bool) -> Iterator[StopFlag]:
    """SIGINT/SIGTERM set a flag that the job checks between stages and after each engine step.
    Handlers can only be installed from the main thread; elsewhere the flag is never set."""
    flag = StopFlag(overwrite)
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.signal(s, flag.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
