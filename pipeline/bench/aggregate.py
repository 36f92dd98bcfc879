"""Medians and spreads over repeats, the ratios the report shows, acceptance by position.

Every ratio divides medians measured in the same interleaved rounds at the same batch size.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, NamedTuple

from pipeline.bench.metrics import CEILING, ENGINE, VARIANTS
from pipeline.stats import Counts

Key = tuple[int, str, int]  # (batch_size, variant, k)


class Summary(NamedTuple):
    """The runs of one variant at one batch size."""

    batch_size: int
    variant: str
    k: int
    runs: list[dict[str, Any]]

    def median(self, column: str) -> float | None:
        values = [r[column] for r in self.runs if r[column] is not None]
        return statistics.median(values) if values else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.median("output_tokens_per_s")

    @property
    def spread(self) -> float | None:
        """(max - min) / median of output tokens/s over the repeats; None for one run."""
        values = [r["output_tokens_per_s"] for r in self.runs]
        middle = statistics.median(values)
        return (max(values) - min(values)) / middle if len(values) > 1 and middle else None

    @property
    def acceptance(self) -> Counts:
        return _spec_counts(self.runs)


def summarize(rows: Iterable[dict[str, Any]]) -> dict[Key, Summary]:
    """Keyed and sorted by batch size, then transformers, engine, perfect drafts, then k."""
    grouped: dict[Key, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["batch_size"], row["variant"], row["k"]), []).append(row)
    order = sorted(grouped, key=lambda key: (key[0], VARIANTS.index(key[1]), key[2]))
    return {key: Summary(*key, grouped[key]) for key in order}


def batch_sizes(summaries: dict[Key, Summary]) -> list[int]:
    return sorted({key[0] for key in summaries})


def engine_ks(summaries: dict[Key, Summary]) -> list[int]:
    return sorted({key[2] for key in summaries if key[1] == ENGINE})


def ratio(summaries: dict[Key, Summary], top: Key, bottom: Key) -> float | None:
    a, b = summaries.get(top), summaries.get(bottom)
    if a is None or b is None or not a.tokens_per_s or not b.tokens_per_s:
        return None
    return a.tokens_per_s / b.tokens_per_s


def round_ratios(summaries: dict[Key, Summary], top: Key, bottom: Key) -> list[float]:
    """top's tokens/s over bottom's within each round (repeat) that ran both, sorted. A round
    runs every variant of a batch size once, back to back, so a slow drift of the machine's
    speed cancels in these ratios; their range says how steady the ratio of medians is."""
    a, b = summaries.get(top), summaries.get(bottom)
    if a is None or b is None:
        return []
    below = {r["repeat"]: r["output_tokens_per_s"] for r in b.runs}
    return sorted(r["output_tokens_per_s"] / below[r["repeat"]] for r in a.runs
                  if below.get(r["repeat"]))


def speedup_vs_k0(summaries: dict[Key, Summary], batch_size: int, k: int,
                  variant: str = ENGINE) -> float | None:
    return ratio(summaries, (batch_size, variant, k), (batch_size, ENGINE, 0))


def ceiling_ks(summaries: dict[Key, Summary]) -> list[int]:
    return sorted({key[2] for key in summaries if key[1] == CEILING})


def best_k(summaries: dict[Key, Summary], batch_size: int) -> Summary | None:
    engines = [s for key, s in summaries.items()
               if key[0] == batch_size and key[1] == ENGINE and s.tokens_per_s]
    return max(engines, key=lambda s: s.tokens_per_s or 0.0) if engines else None


def acceptance_by_k(rows: Iterable[dict[str, Any]]) -> dict[int, Counts]:
    """Engine runs with a drafter, summed over batch sizes and repeats, per k."""
    by_k: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row["variant"] == ENGINE and row["k"] > 0:
            by_k.setdefault(row["k"], []).append(row)
    return {k: _spec_counts(runs) for k, runs in sorted(by_k.items())}


def _spec_counts(runs: list[dict[str, Any]]) -> Counts:
    counts = Counts()
    for r in runs:
        counts.add(Counts(drafted=r["drafted"], accepted=r["accepted"],
                          draft_steps=r["draft_steps"],
                          accepted_per_position=list(r["accepted_per_position"] or [])))
    return counts
