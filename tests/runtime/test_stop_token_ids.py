"""SamplingParams.stop_token_ids: tokens that end a request as EOS does (also with ignore_eos),
held back by min_tokens; the same tokens with drafts as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import SamplingParams
from runtime.request import Completion
from tests.runtime.sampling_cases import PROMPTS, run_prompts

MAX_TOKENS = 16

pytestmark = pytest.mark.usefixtures("one_thread_module")




@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> dict[str, Completion]:
    """Each prompt's greedy tokens, EOS ignored."""
    return run_prompts(tiny_model_dir, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * 5)


def _cut(tokens: tuple[int, ...], stops: set[int], min_tokens: int = 0) -> tuple[int, ...]:
    """Greedy tokens up to the first stop token at or past index min_tokens."""
    for i, t in enumerate(tokens):
        if t in stops and i >= min_tokens:
            return tokens[:i + 1]
    return tokens


def test_a_stop_token_ends_each_request_where_it_first_comes(
        tiny_model_dir: Path, tiny_random_drafter: Path, plain: dict[str, Completion]) -> None:
    """Each request's 4th greedy token, as a stop token id, ends it there (with ignore_eos
    too), its own or another request's: greedy decoding is the same until then. With drafts,
    all accepted or random, the same tokens."""
    stops = tuple(sorted({c.token_ids[3] for c in plain.values()}))
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=stops)] * 5
    got = run_prompts(tiny_model_dir, params)
    for rid, c in got.items():
        expected = _cut(plain[rid].token_ids, set(stops))
        assert c.token_ids == expected and len(expected) <= 4
        assert c.finish_reason == "stop" and c.stop_string is None
    accepted = []
    for options in (dict(reference={r: c.token_ids for r, c in plain.items()}), {}):
        spec = run_prompts(tiny_model_dir, params, drafter=str(tiny_random_drafter),
                    num_speculative_tokens=4, **options)  # type: ignore[arg-type]
        assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids
                                                             for r, c in got.items()}
        accepted.append(sum(c.num_accepted for c in spec.values()))
    # the reference drafts run past the stop token: those were thrown away, the rest accepted
    assert accepted[0] > 0


def test_min_tokens_holds_stop_token_ids_back(tiny_model_dir: Path,
                                              tiny_random_drafter: Path) -> None:
    """A stop token id is held back (its logit -inf) until min_tokens: the tokens equal a
    greedy loop over transformers' logits with that token masked at the first 10 positions,
    then cut at its first coming; with drafts, the same."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    stop = run_prompts(tiny_model_dir, [SamplingParams(max_tokens=3, ignore_eos=True)] * 5)[
        "0"].token_ids[1]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=10,
                             stop_token_ids=(stop,))] * 5
    got = run_prompts(tiny_model_dir, params)
    for rid, c in got.items():
        tokens = list(PROMPTS[int(rid)])
        for i in range(MAX_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            if i < 10:
                logits[stop] = float("-inf")
            tokens.append(int(logits.argmax()))
            if tokens[-1] == stop:
                break
        assert c.token_ids == tuple(tokens[len(PROMPTS[int(rid)]):])
        assert stop not in c.token_ids[:10]
    assert got["0"].token_ids[0] != stop and len(got["0"].token_ids) > 2
    spec = run_prompts(tiny_model_dir, params, drafter=str(tiny_random_drafter),
                num_speculative_tokens=3)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids for r, c in got.items()}


def test_a_stop_token_id_outside_the_vocabulary_fails_its_request_alone(
        tiny_model_dir: Path) -> None:
    params = [SamplingParams(max_tokens=4, stop_token_ids=(3, 256))] + [
        SamplingParams(max_tokens=4)] * 4
    got = run_prompts(tiny_model_dir, params)
    assert got["0"].finish_reason == "error" and got["0"].token_ids == ()
    assert got["0"].error == "stop token id 256 is outside the model's vocabulary (ids 0 to 255)"
    assert {c.finish_reason for rid, c in got.items() if rid != "0"} <= {"stop", "length"}
    with pytest.raises(ValueError, match="stop token ids must be >= 0, got -1"):
        SamplingParams(stop_token_ids=(4, -1))
