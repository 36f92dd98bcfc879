"""Per-shard statistics, their job totals, and OUTPUT_DIR/stats.parquet.

Definitions (speculative decoding):
  drafted / accepted        draft tokens proposed / accepted by verification
  draft_steps               verification steps that checked drafts
  acceptance_rate           accepted / drafted
  mean_acceptance_length    tokens produced per verification step = 1 + accepted / draft_steps
                            (the accepted drafts plus the one token the target always adds)
  per_position_acceptance   [accepted at draft position i / draft_steps for i in 0..k-1], and
                            further where long n-gram lookups (draft_ngram_tokens) were accepted
All three are null (empty list) when nothing was drafted.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.atomic import write_bytes_atomically

STATS_FILE = "stats.parquet"

STATS_SCHEMA = pa.schema([
    ("shard_id", pa.int32()), ("rows", pa.int64()), ("errors", pa.int64()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("wall_seconds", pa.float64()), ("output_tokens_per_s", pa.float64()),
    ("drafted", pa.int64()), ("accepted", pa.int64()), ("draft_steps", pa.int64()),
    ("acceptance_rate", pa.float64()),
    ("mean_acceptance_length", pa.float64()), ("per_position_acceptance", pa.list_(pa.float64())),
    ("committed_at", pa.timestamp("ms", tz="UTC")),
])


@dataclass
class Counts:
    """Raw counters, summable across requests, shards and runs (what the manifest stores)."""

    rows: int = 0  # output rows (input rows x n)
    errors: int = 0  # output rows written with finish_reason "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for name in ("rows", "errors", "prompt_tokens", "completion_tokens", "wall_seconds",
                     "drafted", "accepted", "draft_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.add_positions(other.accepted_per_position)

    def add_positions(self, accepted_per_position: Iterable[int]) -> None:
        for i, count in enumerate(accepted_per_position):
            if i < len(self.accepted_per_position):
                self.accepted_per_position[i] += count
            else:
                self.accepted_per_position.append(count)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        """TypeError where a field is unknown or not a number (a list of integers for
        accepted_per_position)."""
        counts = cls(**data)
        for name, value in asdict(counts).items():
            listed = name == "accepted_per_position"
            numbers = value if listed else [value]
            if not isinstance(numbers, list) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
                raise TypeError(f"a shard's '{name}' is not "
                                f"{'an array of numbers' if listed else 'a number'}")
        return counts

    def impossible(self) -> str | None:
        """The first count that is negative or not finite (a hand-edited file), or None."""
        for name, value in asdict(self).items():
            if name != "accepted_per_position" and not (math.isfinite(value) and value >= 0):
                return name
        return None

    def derived(self) -> dict[str, Any]:
        """The rates of the module docstring."""
        steps = self.draft_steps
        return {
            "output_tokens_per_s": (self.completion_tokens / self.wall_seconds
                                    if self.wall_seconds > 0 else None),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_acceptance_length": 1 + self.accepted / steps if self.drafted and steps else None,
            "per_position_acceptance": ([a / steps for a in self.accepted_per_position]
                                        if self.drafted and steps else []),
        }


def total(counts: Iterable[Counts]) -> Counts:
    result = Counts()
    for c in counts:
        result.add(c)
    return result


def write_stats(output_dir: str, shards: dict[int, Counts],
                committed_at: Mapping[int, float] | None = None) -> None:
    """Rewrite OUTPUT_DIR/stats.parquet (one row per committed shard, by shard id) atomically.
    committed_at: each shard's commit time (Unix seconds); null where unknown."""
    rows = []
    for shard_id in sorted(shards):
        c = shards[shard_id]
        when = (committed_at or {}).get(shard_id)
        rows.append({"shard_id": shard_id, "rows": c.rows, "errors": c.errors,
                     "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                     "wall_seconds": c.wall_seconds, "drafted": c.drafted, "accepted": c.accepted,
                     "draft_steps": c.draft_steps,
                     **c.derived(),
                     "committed_at": None if when is None else round(when * 1000)})
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=STATS_SCHEMA), buffer)
    write_bytes_atomically(os.path.join(output_dir, STATS_FILE), buffer.getvalue())


def shard_spans(shards: dict[int, Counts], committed: dict[int, float | None]
                ) -> dict[int, tuple[float, float]] | None:
    """Each shard's (start, commit) in Unix time, or None unless every commit time is known."""
    if not committed or any(t is None for t in committed.values()):
        return None
    return {s: (t - shards[s].wall_seconds, t) for s, t in committed.items() if t is not None}


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time in which any shard was
    generating. Example: (0, 10), (5, 12), (20, 25) -> 17."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def summary_line(c: Counts, seconds: float) -> str:
    """One line for the end of a job, e.g. 'done: 200 rows (1 error), ... 20.0 tokens/s (prompts
    80.0 tokens/s)': generated tokens per second, then prompt tokens per second (a scoring job,
    --prompt-logprobs --max-tokens 1, is measured by the second)."""
    rate, prompt_rate = ((c.completion_tokens / seconds, c.prompt_tokens / seconds) if seconds > 0
                         else (0.0, 0.0))
    rows, errors = ("row" if c.rows == 1 else "rows"), ("error" if c.errors == 1 else "errors")
    line = (f"done: {c.rows} {rows} ({c.errors} {errors}), {c.prompt_tokens} prompt tokens, "
            f"{c.completion_tokens} generated tokens in {seconds:.1f} s, {rate:.1f} tokens/s "
            f"(prompts {prompt_rate:.1f} tokens/s)")
    if c.drafted:
        d = c.derived()
        positions = ", ".join(f"{p:.2f}" for p in d["per_position_acceptance"])
        line += (f"; acceptance rate {d['acceptance_rate']:.3f}, mean acceptance length "
                 f"{d['mean_acceptance_length']:.2f}, per position [{positions}]")
    return line
