"""The progress bar (stderr): rows done, and in its postfix the prompt tokens per second of the
rows finished (in) and the tokens per second generated (out), as vLLM's bar shows them.

On a terminal tqdm redraws it as rows finish (at most ten times a second) and the rate twice a
second. Where stderr is a file or a pipe (a scheduled job's log) it is written from here as a
line of its own every 30 s: a log collector that reads lines (systemd, Kubernetes) gets each
one as it is written, where tqdm's carriage-return redraws made one line of the whole job.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_POSTFIX_EVERY_S = 0.5  # on a terminal
_LOG_EVERY_S = 30.0  # into a file or pipe


class Progress:
    def __init__(self, total_rows: int, rows_done: int, enabled: bool = True) -> None:
        self._log = not sys.stderr.isatty()
        self._enabled = enabled
        self._every = _LOG_EVERY_S if self._log else _POSTFIX_EVERY_S
        self._bar = None if self._log else tqdm(
            total=total_rows, initial=rows_done, unit="row", file=sys.stderr,
            dynamic_ncols=True, disable=not enabled)
        self._total, self._initial, self._rows = total_rows, rows_done, rows_done
        self._tokens = 0
        self._prompt_tokens = 0  # of the rows finished
        self._start = time.monotonic()
        self._last_drawn = self._start - self._every  # the first call draws

    def rows_done(self, count: int, prompt_tokens: int = 0) -> None:
        self._rows += count
        self._prompt_tokens += prompt_tokens
        if self._bar is not None:
            self._bar.update(count)  # tqdm redraws on a terminal
        else:
            self._draw_if_due()

    def tokens_generated(self, count: int) -> None:
        # drawn here too: a row of many samples (--n) or tokens finishes late, and the bar
        # would stand still until it does
        self._tokens += count
        self._draw_if_due()

    def _draw_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_drawn >= self._every:
            self._last_drawn = now
            self._draw(now)

    def _rate(self, now: float) -> str:
        seconds = max(now - self._start, 1e-9)
        return f"in {self._prompt_tokens / seconds:.1f}, out {self._tokens / seconds:.1f} tok/s"

    def _draw(self, now: float) -> None:
        rate = self._rate(now)
        if self._bar is not None:
            self._bar.set_postfix_str(rate, refresh=True)
        elif self._enabled:
            print(tqdm.format_meter(self._rows, self._total, now - self._start, unit="row",
                                    postfix=rate, initial=self._initial),
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        # the last line shows the whole run's rate (the postfix was drawn up to 30 s before)
        now = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix_str(self._rate(now), refresh=False)
            self._bar.close()
        else:
            self._draw(now)
