"""SamplingParams.guided_regex (runtime.guided.RegexGuide): a state's mask is the brute-force
one over the whole vocabulary; greedy tokens are those of a loop over transformers' logits
masked by a hand-written prefix language; completions ended at EOS match; drafts change no
token."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from runtime.config import SamplingParams
from runtime.guided import RegexGuide
from runtime.regex_dfa import DEAD
from runtime.request import Completion
from runtime.token_bytes import TokenBytes
from tests.runtime.sampling_cases import PROMPTS, masked_greedy_loop, run_prompts

PATTERN = r"[a-e]+[0-9]{2}"
PREFIXES = r"[a-e]*|[a-e]+[0-9]{0,2}"  # the prefixes of PATTERN's matches, by hand

pytestmark = pytest.mark.usefixtures("one_thread_module")




@pytest.mark.parametrize("pattern, texts", [
    (r'\{"name": "[^"]{0,20}", "age": [1-9][0-9]?\}', ['{"na', '{"name": "Ann', '{"name": "Ann",'
                                                        ' "age": 4', '{"name": "é']),
    (r"(Paris|Zürich|Москва) is (big|small)\.", ["", "Z", "Z\u00fc", "Москва is s", "Paris"]),
    (r"[^\n]{1,8}\n", ["", "a b", "a\u00e9\u4e2d"]),
])
def test_a_states_mask_is_the_brute_force_one(smollm2_dir: Path, pattern: str,
                                              texts: list[str]) -> None:
    """The sorted walk with its skips gives, for each state, exactly the tokens whose bytes
    keep the DFA alive (each token walked alone), and EOS where the text is a whole match."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    tokens = TokenBytes(tokenizer, len(tokenizer))
    guide = RegexGuide(pattern, tokens, frozenset({2}))
    for text in texts:
        state = guide.dfa.walk(guide.dfa.start, text.encode())
        assert state != DEAD, text
        brute = [t for t, b in enumerate(tokens.by_id)
                 if b is not None and guide.dfa.walk(state, b) != DEAD]
        expected = brute + ([2] if re.fullmatch(pattern, text) else [])
        assert guide.allowed(state) == expected, text
        assert brute


def _pattern_loop(model: torch.nn.Module, spelled: TokenBytes, prompt: tuple[int, ...],
                  eos: int, pattern: str = PATTERN, prefixes: str = PREFIXES,
                  change: Callable[[torch.Tensor, list[int]], None] | None = None
                  ) -> tuple[int, ...]:
    """12 greedy tokens of transformers' logits, each checked by hand against `prefixes`, EOS
    where the text matches `pattern`."""
    return masked_greedy_loop(
        model, spelled, prompt, eos, 12,
        lambda text: re.fullmatch(prefixes.encode(), text) is not None,
        lambda text: re.fullmatch(pattern, text.decode()) is not None, change)


def _bias_then_penalty(logits: torch.Tensor, tokens: list[int],
                       bias: tuple[tuple[int, float], ...], penalty: float) -> None:
    """The bias, then the repetition penalty over the tokens so far, by hand."""
    for t, b in bias:
        logits[t] += b
    seen = sorted(set(tokens))
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


@pytest.fixture(scope="module")
def guided(tiny_model_dir: Path) -> dict[str, Completion]:
    return run_prompts(tiny_model_dir, [SamplingParams(max_tokens=12, guided_regex=PATTERN)] * 5)


def test_greedy_is_transformers_loop_masked_by_hand(
        tiny_hf_model: torch.nn.Module, tiny_tokenizer: PreTrainedTokenizerFast,
        guided: dict[str, Completion]) -> None:
    spelled = TokenBytes(tiny_tokenizer, len(tiny_tokenizer))
    eos = tiny_tokenizer.eos_token_id
    for rid, c in guided.items():
        assert c.token_ids == _pattern_loop(tiny_hf_model, spelled, PROMPTS[int(rid)], eos)
        text = tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert re.fullmatch(PATTERN, text), text
        else:  # cut by max_tokens: a prefix of a match
            assert re.fullmatch(PREFIXES, text), text
    assert any(c.finish_reason == "stop" for c in guided.values())


def test_with_a_bias_and_a_penalty_the_mask_comes_last(
        tiny_model_dir: Path, tiny_hf_model: torch.nn.Module,
        tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """A pattern that only forbids the letter s, a bias towards the tokens that hold one and a
    repetition penalty: the greedy tokens of transformers' logits so changed, then masked. The
    raw argmax is mostly allowed and the biased one mostly not, so a mask that looked at the
    argmax before the bias would let an s through."""
    pattern, prefixes = "[^s]{1,8}", "[^s]{0,8}"
    spelled = TokenBytes(tiny_tokenizer, len(tiny_tokenizer))
    with_s = [t for t, b in enumerate(spelled.by_id) if b and b"s" in b]
    bias = tuple((t, 8.0) for t in with_s)
    params = [SamplingParams(max_tokens=12, guided_regex=pattern, logit_bias=bias,
                             repetition_penalty=1.5)] * 5
    got = run_prompts(tiny_model_dir, params)
    for rid, c in got.items():
        assert c.token_ids == _pattern_loop(
            tiny_hf_model, spelled, PROMPTS[int(rid)], tiny_tokenizer.eos_token_id, pattern,
            prefixes, lambda logits, tokens: _bias_then_penalty(logits, tokens, bias, 1.5))
        assert "s" not in tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True)
    unguided = run_prompts(tiny_model_dir, [SamplingParams(max_tokens=12, logit_bias=bias)] * 5)
    assert all("s" in tiny_tokenizer.decode(c.token_ids) for c in unguided.values())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_drafts_the_same_tokens(tiny_model_dir: Path, tiny_random_drafter: Path,
                                     tiny_tokenizer: PreTrainedTokenizerFast,
                                     guided: dict[str, Completion], temperature: float) -> None:
    """Random EAGLE drafts, and reference drafts that follow each row's match and then go on
    with letters (which the mask forbids after the digits), give the tokens without drafts."""
    params = [SamplingParams(max_tokens=12, guided_regex=PATTERN, temperature=temperature,
                             seed=i) for i in range(4)] + [
        SamplingParams(max_tokens=12, temperature=temperature, seed=4)]
    alone = run_prompts(tiny_model_dir, params)
    letters = tuple(tiny_tokenizer("abcabc", add_special_tokens=False)["input_ids"])
    reference = {r: c.token_ids[:-1] + letters for r, c in alone.items()}
    for options in (dict(reference=reference), {}):
        spec = run_prompts(tiny_model_dir, params, drafter=str(tiny_random_drafter),
                    num_speculative_tokens=3, **options)  # type: ignore[arg-type]
        assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids
                                                             for r, c in alone.items()}
    if temperature == 0.0:
        assert {r: alone[r].token_ids for r in "0123"} == {r: guided[r].token_ids
                                                           for r in "0123"}


def test_bad_patterns_are_refused_and_a_pattern_no_token_starts_fails_its_request(
        tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"regex '\(a' at position 0: missing '\)'"):
        SamplingParams(guided_regex="(a")
    with pytest.raises(ValueError, match="guided_choice and guided_regex: give one of them"):
        SamplingParams(guided_regex="a", guided_choice=("a",))
    with pytest.raises(ValueError, match="guided regex ends a completion at EOS: not with "
                                         "ignore_eos"):
        SamplingParams(guided_regex="a", ignore_eos=True)
    params = [SamplingParams(max_tokens=4, guided_regex="\u00e6+")] + [
        SamplingParams(max_tokens=4, guided_regex="[ab]+")] * 4
    got = run_prompts(tiny_model_dir, params)
    assert got["0"].finish_reason == "error"
    assert got["0"].error == "guided regex '\u00e6+': no token of this vocabulary starts it"
    assert {c.finish_reason for rid, c in got.items() if rid != "0"} <= {"stop", "length"}


def test_guides_and_masks_let_go_of_give_the_same_tokens(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with patterns of their own, while the engine keeps one guide and one mask at a
    time: each request keeps its own guide (a DFA's state means nothing to another built for
    the same pattern), so the tokens are those of an engine that keeps them all."""
    patterns = [PATTERN, r"[a-e]{2}[0-9]+", r"[0-9]{3}", PATTERN, r"(ab|cd)+9"]
    params = [SamplingParams(max_tokens=12, guided_regex=p) for p in patterns]
    kept = run_prompts(tiny_model_dir, params)
    monkeypatch.setattr("runtime.guided.MAX_GUIDES", 1)
    monkeypatch.setattr("runtime.guided.MAX_MASKS", 1)
    assert {r: c.token_ids for r, c in run_prompts(tiny_model_dir, params).items()} == {
        r: c.token_ids for r, c in kept.items()}
    for rid, c in kept.items():
        assert c.finish_reason == "length" or re.fullmatch(patterns[int(rid)], "".join(
            chr(b) for t in c.token_ids[:-1] for b in _spelled(tiny_model_dir)[t] or b""))


def _spelled(model: Path) -> list[bytes | None]:
    engine_tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    return TokenBytes(engine_tokenizer, len(engine_tokenizer)).by_id
