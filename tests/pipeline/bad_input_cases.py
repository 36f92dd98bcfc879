"""What the tests of inputs that broke jobs share: three prompts, the job's config (INPUT
tmp_path/in, OUTPUT_DIR tmp_path/out, shards of 2 rows, 5 new tokens) and a prompt's greedy
tokens generated alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import JobConfig
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest

PROMPTS = ["Paris is the capital of", "The quick brown fox", "To bake bread, mix"]


def _config(tmp_path: Path, model_dir: Path, **kw: Any) -> JobConfig:
    engine = EngineConfig(model=str(model_dir), kv_cache_memory=16 << 20)
    options = {"input": str(tmp_path / "in"), "output_dir": str(tmp_path / "out"),
               "shard_rows": 2, "max_tokens": 5, **kw}
    return JobConfig(engine=engine, **options)


def _greedy(engine: Engine, prompt: str, max_tokens: int = 5) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=False, add_generation_prompt=True)
    ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    [done] = engine.generate([GenerationRequest("x", ids, SamplingParams(max_tokens=max_tokens))])
    return list(done.token_ids)
