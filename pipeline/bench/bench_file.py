"""bench.parquet: one row per run (metrics.BENCH_SCHEMA), and the run's settings as JSON in the
schema's metadata, so that a report can be written again from the file alone."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.atomic import write_bytes_atomically
from pipeline.bench.config import BenchConfig
from pipeline.bench.metrics import BENCH_SCHEMA
from pipeline.bench.models import BenchModels
from pipeline.bench.workload import Workload
from pipeline.config import JobError, one_line
from runtime.huge_pages import huge_pages_available
from runtime.setup import Placement

METADATA_KEY = b"eaglebatch.bench"


def write_bench_parquet(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Writes the rows (BENCH_SCHEMA) with `meta` as JSON in the schema's metadata, atomically."""
    schema = BENCH_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    write_bytes_atomically(str(path), sink.getvalue().to_pybytes())


def read_bench_parquet(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, metadata) of a bench.parquet; a JobError naming the file if it is not one."""
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise JobError(f"{path}: cannot read it as a bench's Parquet file "
                       f"({one_line(exc)})") from None
    missing = [n for n in BENCH_SCHEMA.names if n not in table.column_names]
    if missing:
        raise JobError(f"{path} lacks the column(s) {', '.join(missing[:5])}: not the "
                       "bench.parquet of an eaglebatch bench")
    return table.to_pylist(), meta


def bench_metadata(config: BenchConfig, models: BenchModels, workload: Workload, p: Placement,
              bandwidth: float | None, max_model_len: int) -> dict[str, Any]:
    """What bench.parquet's metadata records of a run: its options, models, device, threads,
    prompts and placement (the report's header reads it)."""
    lengths = workload.prompt_lengths
    device = (torch.cuda.get_device_name(p.device) if p.device.type == "cuda"
              else cpu_description())
    return {
        "config": asdict(config), "model": config.model, "drafter": models.drafter_label,
        "random_weights": models.random, "random_drafter": models.random_drafter,
        "device": device, "dtype": str(p.dtype).split(".")[-1],
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(lengths),
        "skipped_prompts": workload.skipped, "ignore_eos": workload.ignore_eos,
        "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths),
                          "max": max(lengths)},
        "copy_bandwidth_bytes_per_s": bandwidth, "attention_backend": p.backend,
        "batch1_turns": "request",  # turns(): at batch size 1, rounds go request by request
        "huge_pages": p.device.type == "cpu" and huge_pages_available(),
        # requests whose max_tokens the context lowered
        "clamped": sum(n < config.max_tokens for n in workload.max_tokens),
        "max_model_len": max_model_len,
    }


# CPU flags that change how fast the products run, as named in /proc/cpuinfo -> in the report
_CPU_FEATURES = (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 bfloat16"), ("amx_tile", "AMX"))


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU a bench ran on: its model name, architecture, cores and the vector features that
    set the speed of the products (ratios differ between CPUs: on one 2-core machine type the
    engine's batch-64 ratio over transformers was 2.3x-2.9x, on another 3.4x)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    parts = [platform.machine(), f"{os.cpu_count()} cores"]
    parts += [label for flag, label in _CPU_FEATURES if flag in flags]
    name = fields.get("model name")
    return f"cpu: {name} ({', '.join(parts)})" if name else f"cpu ({', '.join(parts)})"
