"""The transformers baseline decodes plain greedy, whatever the checkpoint's generation_config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pipeline.bench.hf_baseline import TransformersBaseline
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest


def test_the_checkpoints_generation_config_does_not_change_the_baseline(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # as Qwen2.5-Instruct ships it, with a penalty strong enough to change a tiny model's tokens
    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
         "repetition_penalty": 3.0, "min_new_tokens": 4, "eos_token_id": 2}))
    prompts = [(1, 50, 60, 70), (1, 80, 90)]
    baseline = TransformersBaseline(model, torch.device("cpu"), torch.float32,
                                    frozenset({2}), None)
    rows = baseline._generate(prompts, 12, ignore_eos=True, streamer=None)
    engine = Engine(EngineConfig(model=str(model), kv_cache_memory=1 << 20))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    done = {c.request_id: list(c.token_ids) for c in engine.generate(
        GenerationRequest(str(i), p, params) for i, p in enumerate(prompts))}
    assert rows == [done["0"], done["1"]]
