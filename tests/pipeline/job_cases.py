"""The job the run_job tests run: two input files of 5 and 3 rows (one prompt null), its config
(shards of 2 rows, 6 new tokens) and an engine factory that hands out a given engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import JobConfig
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import write_parquet

PROMPTS_A: list[str | None] = ["Paris is the capital of", "The quick brown fox", None,
                               "To bake bread, mix", "The sky is blue because"]
PROMPTS_B: list[str | None] = ["Berlin is", "Once upon a time", "Numbers: 0 1 2"]


def _inputs(tmp_path: Path) -> Path:
    write_parquet(tmp_path / "in" / "a.parquet",
                  {"id": [f"a{i}" for i in range(5)], "prompt": PROMPTS_A, "n": list(range(5))})
    write_parquet(tmp_path / "in" / "b.parquet",
                  {"id": [f"b{i}" for i in range(3)], "prompt": PROMPTS_B, "n": list(range(3))})
    return tmp_path / "in"


def _config(tmp_path: Path, model_dir: Path, out: str = "out", **kw: Any) -> JobConfig:
    engine = EngineConfig(model=str(model_dir), kv_cache_memory=16 << 20)
    options = {"shard_rows": 2, "max_tokens": 6, **kw}
    return JobConfig(input=str(tmp_path / "in"), output_dir=str(tmp_path / out), engine=engine,
                     **options)


def _factory(engine: Engine, seen: list | None = None) -> Callable[[EngineConfig], Engine]:
    def build(config: EngineConfig) -> Engine:
        if seen is not None:
            seen.append(config)
        return engine
    return build
