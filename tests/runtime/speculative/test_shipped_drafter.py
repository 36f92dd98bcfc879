"""The drafter shipped for the default model: small, bf16, found by default, lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.loader import default_drafter
from runtime.request import GenerationRequest

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn rain."]


def test_shipped_drafter_is_small_bf16_and_found_by_default() -> None:
    path = default_drafter("smollm2-135m-instruct")
    assert path is not None
    weights = path / "model.safetensors"
    assert weights.stat().st_size < 30 * 1024 * 1024
    with safe_open(str(weights), "pt") as f:
        floats = [f.get_tensor(k) for k in f.keys() if f.get_tensor(k).is_floating_point()]
    assert floats and all(t.dtype == torch.bfloat16 for t in floats)
    assert default_drafter("some/other/model") is None


@pytest.mark.slow
def test_shipped_drafter_is_lossless_on_the_default_model(smollm2_dir: Path) -> None:
    torch.set_num_threads(1)
    drafter = default_drafter("smollm2-135m-instruct")
    plain = Engine(EngineConfig(kv_cache_memory=1 << 28))
    spec = Engine(EngineConfig(kv_cache_memory=1 << 28, drafter=str(drafter)))
    ids = [plain.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=True)
           for p in PROMPTS]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]

    def run(engine: Engine) -> dict[str, tuple[int, ...]]:
        params = SamplingParams(max_tokens=24)
        requests = [GenerationRequest(str(i), tuple(x), params) for i, x in enumerate(ids)]
        return {c.request_id: c.token_ids for c in engine.generate(requests)}

    assert run(spec) == run(plain)
    assert spec.proposer is not None and spec.proposer.drafter.own_head
