"""SamplingParams.logprobs: each generated token's log-probability under the model's own
distribution, the same bits with drafts as without, and what transformers computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.runtime.logprob_cases import PROMPTS, SAMPLINGS
from tests.runtime.logprob_cases import run as _run

NUM_NEW = 20

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _params(sampling: dict[str, Any], logprobs: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs, **sampling)


def _teacher_forced(model: Any, prompt: tuple[int, ...], tokens: tuple[int, ...]) -> list[float]:
    """transformers' log-softmax of the logits that preceded each of `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled", "penalized",
                                                     "sampled-penalized"])
def test_logprobs_are_the_models_own_before_any_processing(
        tiny_model_dir: Path, tiny_hf_model: Any, sampling: dict[str, Any]) -> None:
    """Each token's log-softmax of the raw logits, as transformers computes them (up to the
    rounding of another product order), whatever the temperature, filters and penalties; the
    tokens are those of a run without logprobs."""
    params = [_params(sampling)] * len(PROMPTS)
    got = _run(tiny_model_dir, params)
    without = _run(tiny_model_dir, [_params(sampling, logprobs=False)] * len(PROMPTS))
    for rid, c in got.items():
        assert c.token_ids == without[rid].token_ids and without[rid].logprobs is None
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == NUM_NEW
        expected = _teacher_forced(tiny_hf_model, PROMPTS[int(rid)], c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < 1e-4
        assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("threads", [1, 2])
def test_logprobs_are_the_same_bits_with_drafts(tiny_model_dir: Path, tiny_random_drafter: Path,
                                                threads: int) -> None:
    """A batch mixing greedy, sampled, penalized and plain requests, some without logprobs:
    with a random drafter, with drafts that are all accepted, and with n-gram drafts, every
    request gets the tokens and log-probabilities (==) of decoding it alone without drafts."""
    torch.set_num_threads(threads)
    params = [_params(SAMPLINGS[0]), _params(SAMPLINGS[1]), _params(SAMPLINGS[2]),
              _params(SAMPLINGS[3]), _params(SAMPLINGS[1], logprobs=False)]
    alone = {}
    for i in range(len(PROMPTS)):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     kv_cache_memory=1 << 20))
        alone.update({c.request_id: (c.token_ids, c.logprobs) for c in engine.generate(
            [GenerationRequest(str(i), PROMPTS[i], params[i])])})
    reference = {rid: tokens for rid, (tokens, _) in alone.items()}
    drafter = tiny_random_drafter
    for options in (dict(drafter=drafter, num_speculative_tokens=4),
                    dict(drafter=drafter, num_speculative_tokens=3, reference=reference),
                    dict(draft_ngram=True, num_speculative_tokens=3)):
        got = _run(tiny_model_dir, params, **options)  # type: ignore[arg-type]
        assert {rid: (c.token_ids, c.logprobs) for rid, c in got.items()} == alone
    assert alone["4"][1] is None


def test_logprobs_stop_with_the_tokens_at_a_stop_token(tiny_model_dir: Path,
                                                       tiny_random_drafter: Path) -> None:
    """Drafts accepted after the token that ends a request are thrown away with their
    log-probabilities: one per kept token."""
    plain = _run(tiny_model_dir, [_params({})] * len(PROMPTS))
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=str(tiny_random_drafter), num_speculative_tokens=4))
    # every draft is accepted, and each request's 8th token ends it (as an EOS would), inside
    # a step of accepted drafts
    engine.draft_from_reference({rid: c.token_ids for rid, c in plain.items()})
    engine.stop.eos_token_ids = frozenset(c.token_ids[7] for c in plain.values())
    requests = [GenerationRequest(str(i), p, SamplingParams(max_tokens=NUM_NEW, logprobs=True))
                for i, p in enumerate(PROMPTS)]
    for c in engine.generate(requests):
        tokens, logprobs = plain[c.request_id].token_ids, plain[c.request_id].logprobs
        assert logprobs is not None
        end = next(i for i, t in enumerate(tokens) if t in engine.stop.eos_token_ids) + 1
        assert c.finish_reason == "stop" and c.token_ids == tokens[:end]
        assert c.logprobs == logprobs[:end]
        assert c.num_accepted < c.num_drafted  # drafts after the EOS were dropped
