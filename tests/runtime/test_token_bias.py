"""SamplingParams.allowed_token_ids and logit_bias (runtime.token_bias): the tokens of a greedy
loop over transformers' logits changed so, in vLLM's order (allowed ids, logit_bias, then
penalties); raw log-probabilities; the same tokens with drafts as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import SamplingParams
from runtime.request import Completion
from tests.runtime.sampling_cases import PROMPTS, run_prompts

MAX_TOKENS = 12
ALLOWED = tuple(range(0, 256, 3))  # every third token

pytestmark = pytest.mark.usefixtures("one_thread_module")




@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> dict[str, Completion]:
    return run_prompts(tiny_model_dir, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * 5)


def _greedy_loop(model: torch.nn.Module, prompt: tuple[int, ...], params: SamplingParams
                 ) -> tuple[tuple[int, ...], list[float]]:
    """Greedy tokens of transformers' logits with the allowed ids, the bias and then the
    repetition penalty applied by hand, and each token's raw log-probability."""
    tokens, logprobs = list(prompt), []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            raw = model(torch.tensor([tokens])).logits[0, -1].float()
        logits = raw.clone()
        if params.allowed_token_ids:
            mask = torch.full_like(logits, float("-inf"))
            mask[list(params.allowed_token_ids)] = 0.0
            logits = logits + mask
        for token, bias in params.logit_bias:
            logits[token] += bias
        if params.repetition_penalty != 1.0:
            seen = sorted(set(tokens))
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
        tokens.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(raw, dim=-1)[tokens[-1]]))
    return tuple(tokens[len(prompt):]), logprobs


def _params(plain: dict[str, Completion]) -> list[SamplingParams]:
    """Allowed ids; a bias that bans each prompt's first greedy token and lifts two others;
    both with a repetition penalty; none (a plain row beside them); the bias again."""
    base = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
    bias = tuple(sorted({(plain["1"].token_ids[0], -100.0), (17, 4.5), (90, 3.0)}))
    return [SamplingParams(**{**base.__dict__, "allowed_token_ids": ALLOWED}),
            SamplingParams(**{**base.__dict__, "logit_bias": bias}),
            SamplingParams(**{**base.__dict__, "allowed_token_ids": ALLOWED, "logit_bias": (
                (ALLOWED[5], 2.0),), "repetition_penalty": 1.3}),
            base,
            SamplingParams(**{**base.__dict__, "logit_bias": bias})]


def test_allowed_ids_and_logit_bias_give_transformers_greedy_loop_with_them(
        tiny_model_dir: Path, hf_model: torch.nn.Module, plain: dict[str, Completion]) -> None:
    params = _params(plain)
    got = run_prompts(tiny_model_dir, params)
    for rid, c in got.items():
        tokens, logprobs = _greedy_loop(hf_model, PROMPTS[int(rid)], params[int(rid)])
        assert c.token_ids == tokens
        # log-probabilities are the raw distribution's, as vLLM's raw_logprobs
        assert c.logprobs is not None
        assert max(abs(a - b) for a, b in zip(c.logprobs, logprobs, strict=True)) < 1e-4
    assert set(got["0"].token_ids + got["2"].token_ids) <= set(ALLOWED)
    assert got["3"].token_ids == plain["3"].token_ids  # the plain row beside them
    for rid in "0124":  # each setting changed its row's tokens
        assert got[rid].token_ids != plain[rid].token_ids
    assert plain["1"].token_ids[0] not in got["1"].token_ids + got["4"].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_with_drafts_the_same_tokens(tiny_model_dir: Path, tiny_random_drafter: Path,
                                     plain: dict[str, Completion], temperature: float) -> None:
    """Random EAGLE drafts and reference drafts (the unbiased greedy tokens, which the biased
    rows reject) give the tokens of decoding without drafts, greedy and seeded sampling."""
    params = [SamplingParams(**{**p.__dict__, "temperature": temperature, "seed": 11 + i})
              for i, p in enumerate(_params(plain))]
    alone = run_prompts(tiny_model_dir, params)
    for options in (dict(reference={r: c.token_ids for r, c in plain.items()}), {}):
        spec = run_prompts(tiny_model_dir, params, drafter=str(tiny_random_drafter),
                    num_speculative_tokens=3, **options)  # type: ignore[arg-type]
        assert {r: (c.token_ids, c.logprobs) for r, c in spec.items()} == {
            r: (c.token_ids, c.logprobs) for r, c in alone.items()}
        assert sum(c.num_drafted for c in spec.values()) > 0


def test_ids_outside_the_vocabulary_fail_their_request_alone(tiny_model_dir: Path) -> None:
    params = [SamplingParams(max_tokens=4, allowed_token_ids=(3, 256)),
              SamplingParams(max_tokens=4, logit_bias=((300, 1.0),))] + [
        SamplingParams(max_tokens=4)] * 3
    got = run_prompts(tiny_model_dir, params)
    assert got["0"].finish_reason == "error" and got["0"].error == (
        "allowed token id 256 is outside the model's vocabulary (ids 0 to 255)")
    assert got["1"].finish_reason == "error" and got["1"].error == (
        "logit_bias token id 300 is outside the model's vocabulary (ids 0 to 255)")
    assert {c.finish_reason for rid, c in got.items() if rid not in "01"} <= {"stop", "length"}


@pytest.mark.parametrize("kw, message", [
    (dict(logit_bias=((4, 100.5),)), r"logit_bias of token 4 must be in \[-100, 100\], got 100.5"),
    (dict(logit_bias=((4, float("nan")),)), r"logit_bias of token 4 must be in"),
    (dict(logit_bias=((4, 1.0), (4, 2.0))), "logit_bias gives token 4 more than one bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias token ids must be >= 0, got -1"),
    (dict(allowed_token_ids=(2, -3)), "allowed token ids must be >= 0, got -3"),
])
def test_bad_values_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)  # type: ignore[arg-type]
