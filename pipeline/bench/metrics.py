"""What one timed run measured, and how it becomes one row of bench.parquet.

All requests of a run are submitted at t0 (the engine pulls them as its batch has room; the
baseline runs them in static batches in order), so a request's latency includes its queueing:
    latency = finish time - t0        time to first token (ttft) = first token time - t0

A run may be taken in parts, in turns with the other variants (at batch size 1 the bench runs
each variant request by request): its clock stops between parts (RunRecord.pause / resume), so
the times are those of one run of all its requests in a row.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.stats import Counts

BENCH_FILE = "bench.parquet"

BENCH_SCHEMA = pa.schema([
    ("order", pa.int32()), ("repeat", pa.int32()), ("batch_size", pa.int32()),
    ("variant", pa.string()), ("k", pa.int32()), ("requests", pa.int64()),
    ("output_tokens", pa.int64()), ("wall_seconds", pa.float64()),
    ("output_tokens_per_s", pa.float64()), ("requests_per_s", pa.float64()),
    ("latency_mean_s", pa.float64()), ("latency_p50_s", pa.float64()),
    ("latency_p99_s", pa.float64()), ("ttft_mean_s", pa.float64()), ("ttft_p50_s", pa.float64()),
    ("ttft_p99_s", pa.float64()), ("drafted", pa.int64()), ("accepted", pa.int64()),
    ("draft_steps", pa.int64()), ("accepted_per_position", pa.list_(pa.int64())),
    ("acceptance_rate", pa.float64()), ("mean_acceptance_length", pa.float64()),
    ("per_position_acceptance", pa.list_(pa.float64())), ("peak_rss_bytes", pa.int64()),
    ("peak_gpu_bytes", pa.int64()), ("decode_step_s", pa.float64()),
    ("bandwidth_floor_s", pa.float64()), ("outputs_equal", pa.int64()),
    ("outputs_compared", pa.int64()), ("first_divergence", pa.int64()),
])

ENGINE = "engine"
TRANSFORMERS = "transformers"
CEILING = "perfect drafts"  # the engine drafting the k = 0 run's own tokens (--ceiling)
VARIANTS = (TRANSFORMERS, ENGINE, CEILING)  # the order of the report's tables


def variant_label(variant: str, k: int) -> str:
    """'transformers', 'engine k=0' (no drafter), 'engine k=3', 'perfect drafts k=3'."""
    return variant if variant == TRANSFORMERS else f"{variant} k={k}"


class RssSampler:
    """Peak resident memory of this process over the calls to sample() (Linux: /proc/self/statm;
    elsewhere the process's lifetime peak from getrusage)."""

    def __init__(self) -> None:
        self.peak = 0
        self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, _rss_bytes())


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


@dataclass
class RunRecord:
    """Filled in while a run goes on; times are on clock(): time.perf_counter() less the time
    the run was paused (between its parts)."""

    variant: str
    k: int
    batch_size: int
    t0: float = field(default_factory=lambda: time.perf_counter())
    end: float = 0.0
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    first_token_at: dict[str, float] = field(default_factory=dict)
    spec: Counts = field(default_factory=Counts)  # drafted / accepted / draft_steps / positions
    rss: RssSampler = field(default_factory=RssSampler)
    peak_gpu_bytes: int | None = None
    decode_step_s: float | None = None
    bandwidth_floor_s: float | None = None
    # every decode-only step of the run: its seconds and the context tokens it read
    decode_steps: list[float] = field(default_factory=list)
    decode_contexts: list[int] = field(default_factory=list)
    paused_s: float = 0.0  # clock time left out: the gaps between the run's parts

    def clock(self) -> float:
        return time.perf_counter() - self.paused_s

    def pause(self) -> None:
        """The end of a part: the clock stops at `end` (until resume)."""
        self.end = self.clock()

    def resume(self) -> RunRecord:
        """The start of the next part of a paused run: the clock goes on from `end`."""
        self.paused_s = time.perf_counter() - self.end
        return self

    def first_token(self, request_id: str, now: float) -> None:
        self.first_token_at.setdefault(request_id, now)

    def finish(self, request_id: str, token_ids: Sequence[int], now: float) -> None:
        self.outputs[request_id] = tuple(token_ids)
        self.finished_at[request_id] = now
        self.first_token(request_id, now)  # a request that finished in its first step


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100), numpy's default; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Agreement:
    """Outputs of a run compared request by request with the reference run's."""

    def __init__(self, reference: dict[str, tuple[int, ...]],
                 outputs: dict[str, tuple[int, ...]]) -> None:
        self.compared = len(reference)
        self.equal = sum(outputs.get(rid) == ids for rid, ids in reference.items())
        divergences = [_first_difference(ids, outputs.get(rid, ())) for rid, ids in
                       reference.items() if outputs.get(rid) != ids]
        self.first_divergence = min(divergences) if divergences else None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def bench_row(record: RunRecord, order: int, repeat: int, agreement: Agreement) -> dict[str, Any]:
    wall = record.end - record.t0
    tokens = sum(len(ids) for ids in record.outputs.values())
    latencies = [t - record.t0 for t in record.finished_at.values()]
    ttfts = [t - record.t0 for t in record.first_token_at.values()]
    derived = record.spec.derived()
    return {
        "order": order, "repeat": repeat, "batch_size": record.batch_size,
        "variant": record.variant, "k": record.k, "requests": len(record.outputs),
        "output_tokens": tokens, "wall_seconds": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(record.outputs) / wall if wall > 0 else None,
        "latency_mean_s": _mean(latencies), "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99), "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "drafted": record.spec.drafted, "accepted": record.spec.accepted,
        "draft_steps": record.spec.draft_steps,
        "accepted_per_position": list(record.spec.accepted_per_position),
        "acceptance_rate": derived["acceptance_rate"],
        "mean_acceptance_length": derived["mean_acceptance_length"],
        "per_position_acceptance": derived["per_position_acceptance"],
        "peak_rss_bytes": record.rss.peak, "peak_gpu_bytes": record.peak_gpu_bytes,
        "decode_step_s": record.decode_step_s, "bandwidth_floor_s": record.bandwidth_floor_s,
        "outputs_equal": agreement.equal, "outputs_compared": agreement.compared,
        "first_divergence": agreement.first_divergence,
    }
