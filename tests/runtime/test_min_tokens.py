"""min_tokens: EOS held back until a request has that many tokens, as transformers'
min_new_tokens; the same tokens with drafts as without."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest

PROMPTS = [(5, 9, 5, 9, 5), (200, 3), (40, 41, 42, 40, 41, 42, 40), (7,), (100, 100, 100, 12)]
MAX_TOKENS = 16

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def early_eos(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny model with an EOS id that its greedy decoding of PROMPTS[0] makes third."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20))
    eos = next(engine.generate([GenerationRequest("0", PROMPTS[0], SamplingParams(
        max_tokens=3, ignore_eos=True))])).token_ids[2]
    model = tmp_path_factory.mktemp("early-eos") / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    return model, eos


def _run(model: Path, params: SamplingParams, **options: Any) -> dict[str, Completion]:
    reference = options.pop("reference", None)
    engine = Engine(EngineConfig(model=str(model), block_size=4, kv_cache_memory=1 << 20,
                                 **options))
    if reference is not None:
        engine.draft_from_reference(reference)
    requests = [GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)]
    return {c.request_id: c for c in engine.generate(requests)}


def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(
        early_eos: tuple[Path, int], tiny_hf_model: Any, tiny_random_drafter: Path) -> None:
    model, eos = early_eos
    plain = _run(model, SamplingParams(max_tokens=MAX_TOKENS))
    assert plain["0"].finish_reason == "stop" and len(plain["0"].token_ids) == 3
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=10)
    held = _run(model, params)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = tiny_hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                         max_new_tokens=MAX_TOKENS, min_new_tokens=10,
                                         eos_token_id=eos, pad_token_id=eos,
                                         attention_mask=torch.ones(1, len(prompt)))
        expected = tuple(out[0, len(prompt):].tolist())
        if eos in expected:  # transformers pads after EOS
            expected = expected[:expected.index(eos) + 1]
        assert held[str(i)].token_ids == expected
        assert eos not in held[str(i)].token_ids[:10]
    assert held["0"].token_ids[:2] == plain["0"].token_ids[:2] and len(held["0"].token_ids) > 3
    # drafts across the 10th token: all accepted (the held output itself), or a random drafter
    reference = {rid: c.token_ids for rid, c in held.items()}
    for options in ({"reference": reference}, {}):
        spec = _run(model, params, drafter=str(tiny_random_drafter), num_speculative_tokens=4,
                    **options)
        assert {k: c.token_ids for k, c in spec.items()} == {k: c.token_ids
                                                               for k, c in held.items()}
    # a sampled, penalized request with logprobs: the same with drafts as without
    sampled = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=12, temperature=1.0, seed=2,
                             repetition_penalty=1.1, logprobs=True)
    alone = _run(model, sampled)
    spec = _run(model, sampled, drafter=str(tiny_random_drafter), num_speculative_tokens=3)
    assert {k: (c.token_ids, c.logprobs) for k, c in spec.items()} == {
        k: (c.token_ids, c.logprobs) for k, c in alone.items()}
    assert all(len(c.token_ids) >= 12 for c in alone.values())
    with pytest.raises(ValueError, match="min_tokens must be >= 0, got -1"):
        SamplingParams(min_tokens=-1)


def test_hold_eos_holds_the_rows_with_fewer_than_min_tokens_before_them() -> None:
    from runtime.penalties import hold_eos  # noqa: PLC0415
    from runtime.sequence import Sequence  # noqa: PLC0415

    short = Sequence("a", [1, 2], SamplingParams(min_tokens=4), arrival=0,
                     num_speculative_tokens=2)
    short.token_ids += [5, 6]  # 2 outputs: its rows with 2 and 3 outputs before them are held
    done = Sequence("b", [1], SamplingParams(min_tokens=1), arrival=1, num_speculative_tokens=2)
    done.token_ids += [5]
    logits = torch.zeros(5, 8)
    hold_eos(logits, [short, done], [[3, 4], [3]], frozenset({0, 7}))
    assert (logits == float("-inf")).nonzero().tolist() == [[0, 0], [0, 7], [1, 0], [1, 7]]
