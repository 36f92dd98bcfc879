"""SamplingParams.top_logprobs: the most likely tokens where each token was drawn, with their
log-probabilities; the same bits with drafts as without, and what transformers computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import MAX_TOP_LOGPROBS, EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from runtime.sampler import _most_likely
from tests.runtime.logprob_cases import PROMPTS, SAMPLINGS
from tests.runtime.logprob_cases import run as _run

NUM_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _params(sampling: dict[str, Any], top: int = 5, logprobs: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, top_logprobs=top,
                          logprobs=logprobs, **sampling)


def test_most_likely_breaks_ties_by_the_lowest_id_inside_and_at_the_edge() -> None:
    """Equal values inside the k come lowest id first, and where values outside the k equal the
    k-th, the lowest ids are the ones kept: a stable descending sort's first k."""
    rows = torch.tensor([[0.0, -1.0, -2.0, -1.0, -1.0, -3.0, -1.0],
                         [-5.0, -4.0, -4.0, -4.0, -4.0, -4.0, -4.0],
                         [-0.5, -0.25, -2.0, -0.125, -9.0, -1.0, -0.75]])
    assert _most_likely(rows, 3) == [((0, 0.0), (1, -1.0), (3, -1.0)),
                                     ((1, -4.0), (2, -4.0), (3, -4.0)),
                                     ((3, -0.125), (1, -0.25), (0, -0.5))]
    # many rows of few distinct values: each row's result is its stable sort's first k, alone
    # or among other rows
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 4, (64, 300), generator=gen).float().neg()
    values, order = many.sort(dim=-1, descending=True, stable=True)
    expected = [tuple(zip(o[:20], v[:20], strict=True))
                for o, v in zip(order.tolist(), values.tolist(), strict=True)]
    assert _most_likely(many, 20) == expected
    assert [_most_likely(many[i:i + 1], 20)[0] for i in range(64)] == expected


def test_top_logprobs_are_out_of_range_beyond_twenty() -> None:
    assert SamplingParams(top_logprobs=MAX_TOP_LOGPROBS).top_logprobs == 20
    for bad in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(ValueError, match=r"^top_logprobs must be in \[0, 20\]"):
            SamplingParams(top_logprobs=bad)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled", "penalized",
                                                     "sampled-penalized"])
def test_top_logprobs_are_the_models_own_most_likely_tokens(
        tiny_model_dir: Path, tiny_hf_model: Any, sampling: dict[str, Any]) -> None:
    """At each token, the n tokens of largest log-softmax of the raw logits (before penalties,
    temperature and filters), as transformers computes them (up to the rounding of another
    product order), most likely first; the tokens are those of a run without them, and a greedy
    row's own token heads each list."""
    n = 7
    got = _run(tiny_model_dir, [_params(sampling, top=n)] * len(PROMPTS))
    without = _run(tiny_model_dir, [_params(sampling, top=0)] * len(PROMPTS))
    for rid, c in got.items():
        assert c.token_ids == without[rid].token_ids and without[rid].top_logprobs is None
        assert c.logprobs is None  # only asked for with logprobs=True
        assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids) == NUM_NEW
        prompt = PROMPTS[int(rid)]
        with torch.no_grad():
            logits = tiny_hf_model(torch.tensor([prompt + c.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for position, top in enumerate(c.top_logprobs):
            ids = [i for i, _ in top]
            values = [v for _, v in top]
            assert len(top) == n and len(set(ids)) == n
            assert values == sorted(values, reverse=True)
            row = expected[position]
            # the same values at the same ids, and no token outside them more likely
            assert max(abs(row[i].item() - v) for i, v in top) < 1e-4
            outside = row.clone()
            outside[ids] = float("-inf")
            assert outside.max().item() < values[-1] + 1e-4
            if not sampling:
                assert ids[0] == c.token_ids[position]


@pytest.mark.parametrize("threads", [1, 2])
def test_top_logprobs_are_the_same_bits_with_drafts(tiny_model_dir: Path,
                                                    tiny_random_drafter: Path,
                                                    threads: int) -> None:
    """A batch mixing greedy, sampled and penalized requests with 1-20 top tokens, some with
    logprobs too and one with neither: with a random drafter, with drafts that are all accepted,
    and with n-gram drafts, every request gets the tokens and lists (==) of decoding it alone
    without drafts."""
    torch.set_num_threads(threads)
    params = [_params(SAMPLINGS[0], top=1), _params(SAMPLINGS[1], top=20, logprobs=True),
              _params(SAMPLINGS[2], top=3), _params(SAMPLINGS[3], top=5, logprobs=True),
              _params(SAMPLINGS[0], top=0)]
    alone = {}
    for i in range(len(PROMPTS)):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     kv_cache_memory=1 << 20))
        alone.update({c.request_id: (c.token_ids, c.logprobs, c.top_logprobs)
                      for c in engine.generate([GenerationRequest(str(i), PROMPTS[i],
                                                                  params[i])])})
    reference = {rid: tokens for rid, (tokens, _, _) in alone.items()}
    for options in (dict(drafter=tiny_random_drafter, num_speculative_tokens=4),
                    dict(drafter=tiny_random_drafter, num_speculative_tokens=3,
                         reference=reference),
                    dict(draft_ngram=True, num_speculative_tokens=3)):
        got = _run(tiny_model_dir, params, **options)  # type: ignore[arg-type]
        assert {rid: (c.token_ids, c.logprobs, c.top_logprobs)
                for rid, c in got.items()} == alone
    assert [len(alone[str(i)][2][0]) for i in range(4)] == [1, 20, 3, 5]  # type: ignore[index]
    assert alone["4"][1:] == (None, None) and alone["2"][1] is None
    # a row's logprobs are its token's entry in its own top list where the token is in it
    tokens, logprobs, top = alone["1"]
    assert logprobs is not None and top is not None
    found = [dict(t)[tok] == lp for tok, lp, t in zip(tokens, logprobs, top, strict=True)
             if tok in dict(t)]
    assert found and all(found)


def test_top_logprobs_stop_with_the_tokens_at_a_stop_token(tiny_model_dir: Path,
                                                           tiny_random_drafter: Path) -> None:
    """Drafts accepted after the token that ends a request are thrown away with their lists."""
    plain = _run(tiny_model_dir, [_params({}, top=4)] * len(PROMPTS))
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=str(tiny_random_drafter), num_speculative_tokens=4))
    engine.draft_from_reference({rid: c.token_ids for rid, c in plain.items()})
    engine.stop.eos_token_ids = frozenset(c.token_ids[7] for c in plain.values())
    requests = [GenerationRequest(str(i), p, SamplingParams(max_tokens=NUM_NEW, top_logprobs=4))
                for i, p in enumerate(PROMPTS)]
    for c in engine.generate(requests):
        tokens, top = plain[c.request_id].token_ids, plain[c.request_id].top_logprobs
        assert top is not None
        end = next(i for i, t in enumerate(tokens) if t in engine.stop.eos_token_ids) + 1
        assert c.finish_reason == "stop" and c.token_ids == tokens[:end]
        assert c.top_logprobs == top[:end]
        assert c.num_accepted < c.num_drafted
