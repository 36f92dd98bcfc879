"""The `eaglebatch` command: Ctrl-C and SIGTERM while it starts (seconds of importing torch and
transformers, before any command has run) end it with a message instead of a traceback or a
silent kill; then the commands' own handling takes over."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _starting(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("interrupted while starting, before anything was done: rerun the same "
                     "command\n")
    sys.stderr.flush()
    # not SystemExit: libraries import optional parts under bare `except:`, which would swallow
    # it and carry on. Nothing is open or written yet, so there is nothing to clean up
    os._exit(128 + signum)


def main() -> None:
    previous = {s: signal.signal(s, _starting) for s in (signal.SIGINT, signal.SIGTERM)}
    from jobs.cli import main as command_line  # noqa: PLC0415 (the imports this covers)

    for s, handler in previous.items():
        signal.signal(s, handler)
    command_line()
