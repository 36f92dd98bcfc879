"""The progress bar (stderr): rows done, and generated tokens per second in the postfix."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_POSTFIX_EVERY_S = 0.5


class Progress:
    def __init__(self, total_rows: int, rows_done: int, enabled: bool = True) -> None:
        self._bar = tqdm(total=total_rows, initial=rows_done, unit="row", file=sys.stderr,
                         dynamic_ncols=True, disable=not enabled)
        self._tokens = 0
        self._start = time.monotonic()
        self._last_postfix = 0.0

    def rows_done(self, count: int) -> None:
        self._bar.update(count)

    def tokens_generated(self, count: int) -> None:
        self._tokens += count
        now = time.monotonic()
        if now - self._last_postfix >= _POSTFIX_EVERY_S:
            self._last_postfix = now
            rate = self._tokens / max(now - self._start, 1e-9)
            # redrawn here too: a row of many samples (--n) or tokens finishes late, and the
            # bar would stand still until it does
            self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=True)

    def close(self) -> None:
        self._bar.close()
