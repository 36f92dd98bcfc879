"""The progress bar (stderr): rows done, and generated tokens per second in the postfix.

On a terminal it is redrawn about twice a second; where stderr is a file or a pipe (a scheduled
job's log) every 30 s, so that a long job does not fill its log with redraws."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_POSTFIX_EVERY_S = 0.5  # on a terminal
_LOG_EVERY_S = 30.0  # into a file or pipe


class Progress:
    def __init__(self, total_rows: int, rows_done: int, enabled: bool = True) -> None:
        self._every = _POSTFIX_EVERY_S if sys.stderr.isatty() else _LOG_EVERY_S
        self._bar = tqdm(total=total_rows, initial=rows_done, unit="row", file=sys.stderr,
                         dynamic_ncols=True, disable=not enabled,
                         mininterval=0.1 if self._every < 1 else self._every)
        self._tokens = 0
        self._start = time.monotonic()
        self._last_postfix = self._start - self._every  # the first call draws

    def rows_done(self, count: int) -> None:
        self._bar.update(count)

    def tokens_generated(self, count: int) -> None:
        self._tokens += count
        now = time.monotonic()
        if now - self._last_postfix >= self._every:
            self._last_postfix = now
            rate = self._tokens / max(now - self._start, 1e-9)
            # redrawn here too: a row of many samples (--n) or tokens finishes late, and the
            # bar would stand still until it does
            self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=True)

    def close(self) -> None:
        self._bar.close()
