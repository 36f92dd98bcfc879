"""The drafter shipped for the default model: small, bf16, found by default, lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_gemm import PrepackedLinear
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
    int8 = Engine(EngineConfig(kv_cache_memory=1 << 28, drafter=str(drafter), draft_int8=True,
                               draft_ngram=True))  # the CLI's defaults
    ids = [plain.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=True)
           for p in PROMPTS]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]

    def run(engine: Engine) -> dict[str, tuple[int, ...]]:
        params = SamplingParams(max_tokens=24)
        requests = [GenerationRequest(str(i), tuple(x), params) for i, x in enumerate(ids)]
        return {c.request_id: c.token_ids for c in engine.generate(requests)}

    want = run(plain)
    assert run(spec) == want
    assert spec.proposer is not None and spec.proposer.drafter.own_head
    # int8 drafter weights and n-gram drafts: other drafts, the same tokens, drafts still accepted
    assert run(int8) == want
    assert int8.proposer is not None
    if int8.placement.device.type == "cpu":  # int8 copies are a CPU feature (CUDA: no-op)
        packed = [m for m in int8.proposer.drafter.modules() if isinstance(m, PrepackedLinear)]
        assert len(packed) == 16 and all(m._packed.dtype == torch.int8 for m in packed)
        # only the int8 copies stay: the drafter's float32 weights, its head's too, are let go
        assert all(m.weight is None for m in packed)
    seq_accepted = sum(c.num_accepted for c in int8.generate(
        [GenerationRequest("a", tuple(ids[0]), SamplingParams(max_tokens=24))]))
    assert seq_accepted > 0
