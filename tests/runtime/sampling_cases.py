"""What the sampling-option tests (test_stop_token_ids, test_token_bias, test_guided_choice,
test_guided_regex) share: five prompts of the tiny llama, their run on a fresh engine (with
reference drafts where given), and a greedy loop over transformers' logits whose tokens are
checked by hand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from runtime.token_bytes import TokenBytes

PROMPTS = [(5, 9, 5, 9, 5), (200, 3), (40, 41, 42, 40, 41, 42, 40), (7,), (100, 100, 100, 12)]


def run_prompts(model: Path, params: list[SamplingParams], reference: dict[str, tuple[int, ...]]
                | None = None, **options: object) -> dict[str, Completion]:
    """PROMPTS with params[i] each, by request id ("0" .. "4"), on an engine of `model`."""
    engine = Engine(EngineConfig(model=str(model), block_size=4, kv_cache_memory=1 << 20,
                                 **options))  # type: ignore[arg-type]
    if reference is not None:
        engine.draft_from_reference(reference)
    requests = [GenerationRequest(str(i), p, s) for i, (p, s) in enumerate(
        zip(PROMPTS, params, strict=True))]
    return {c.request_id: c for c in engine.generate(requests)}


def masked_greedy_loop(model: torch.nn.Module, spelled: TokenBytes, prompt: tuple[int, ...],
                       eos: int, max_tokens: int, goes_on: Callable[[bytes], bool],
                       whole: Callable[[bytes], bool],
                       change: Callable[[torch.Tensor, list[int]], None] | None = None
                       ) -> tuple[int, ...]:
    """Greedy tokens of transformers' logits (first changed in place by change(logits, tokens
    so far), where given), every token checked by hand at each step: allowed where
    goes_on(text so far + its bytes), EOS where whole(text so far)."""
    tokens, text = list(prompt), b""
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        if change is not None:
            change(logits, tokens)
        for t in range(len(logits)):
            b = spelled.by_id[t]
            if not ((t == eos and whole(text)) or (b is not None and goes_on(text + b))):
                logits[t] = float("-inf")
        tokens.append(int(logits.argmax()))
        if tokens[-1] == eos:
            break
        text += spelled.by_id[tokens[-1]] or b""
    return tuple(tokens[len(prompt):])
