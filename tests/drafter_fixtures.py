"""Random-weight EAGLE drafters for tests, saved in the public checkpoint layout."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, LlamaConfig

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from runtime.speculative.checkpoint import drafter_config_dict, save_drafter_checkpoint
from runtime.speculative.drafter import EagleDrafter

DRAFT_PROMPTS = ([5, 9, 13, 2, 77, 31, 8], [200, 3],
                 [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])


def make_random_drafter(target_dir: Path, out_dir: Path, *, num_layers: int = 2,
                        aux_layer_ids: tuple[int, ...] | None = None,
                        style: str = "eagle1", seed: int = 0, draft_vocab_size: int | None = None,
                        **overrides: object) -> Path:
    target = AutoConfig.from_pretrained(target_dir)
    raw = drafter_config_dict(target, num_layers, style, draft_vocab_size, aux_layer_ids,
                              **overrides)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(seed)
    names = [f"layers.{target.num_hidden_layers + i}" for i in range(num_layers)]
    drafter = EagleDrafter(config, style, None, names, "torch", fc_bias=style == "eagle1",  # type: ignore[arg-type]
                           windows=[None] * num_layers)
    state = drafter.state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point() and "norm" not in name:
            tensor.normal_(0.0, 0.1)
    if style == "eagle3" and draft_vocab_size:
        chosen = torch.randperm(target.vocab_size)[:draft_vocab_size].sort().values
        state["d2t"] = chosen - torch.arange(draft_vocab_size)
    return save_drafter_checkpoint(out_dir, raw, state, style)


def generate_greedy(model_dir: Path, drafter: Path | None, max_tokens: int = 20
                    ) -> dict[str, Completion]:
    """DRAFT_PROMPTS decoded greedily (EOS ignored) by `model_dir`, with `drafter` or none."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=str(drafter) if drafter else None))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(DRAFT_PROMPTS)]
    return {c.request_id: c for c in engine.generate(requests)}
