"""SamplingParams.guided_choice (runtime.guided): the tokens of a greedy loop over transformers'
logits masked to the choices by brute force; every completion ended at EOS is a choice; the
same tokens with drafts as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from runtime.token_bytes import TokenBytes
from tests.runtime.sampling_cases import PROMPTS, masked_greedy_loop, run_prompts

# overlapping choices: after "Par" both go on; "yes" is whole where "yes, sir" goes on
CHOICES = ("Paris", "Parma", "yes", "yes, sir", "Rome")

pytestmark = pytest.mark.usefixtures("one_thread_module")




@pytest.fixture(scope="module")
def guided(tiny_model_dir: Path) -> dict[str, Completion]:
    return run_prompts(tiny_model_dir, [SamplingParams(max_tokens=16, guided_choice=CHOICES)] * 5)


def test_greedy_choices_are_transformers_loop_masked_by_hand(
        tiny_model_dir: Path, tiny_hf_model: torch.nn.Module,
        tiny_tokenizer: PreTrainedTokenizerFast, guided: dict[str, Completion]) -> None:
    spelled = TokenBytes(tiny_tokenizer, len(tiny_tokenizer))
    eos = tiny_tokenizer.eos_token_id
    wanted = [c.encode() for c in CHOICES]  # a token goes on along one, EOS ends one
    for rid, c in guided.items():
        assert c.token_ids == masked_greedy_loop(
            tiny_hf_model, spelled, PROMPTS[int(rid)], eos, 16,
            lambda text: any(w.startswith(text) for w in wanted), lambda text: text in wanted)
        assert c.finish_reason == "stop" and c.token_ids[-1] == eos
        assert tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True) in CHOICES
    # a random model: letter by letter, to more than one choice
    assert len({c.token_ids for c in guided.values()}) > 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_drafts_the_same_tokens(tiny_model_dir: Path, tiny_random_drafter: Path,
                                     tiny_tokenizer: PreTrainedTokenizerFast,
                                     guided: dict[str, Completion], temperature: float) -> None:
    """Random EAGLE drafts, and reference drafts that spell a choice other than the one taken
    (rejected where they part), give the tokens of decoding without drafts; a guided row
    beside plain ones."""
    params = [SamplingParams(max_tokens=16, guided_choice=CHOICES, temperature=temperature,
                             seed=i) for i in range(4)] + [
        SamplingParams(max_tokens=16, temperature=temperature, seed=4)]
    alone = run_prompts(tiny_model_dir, params)
    for c in list(alone.values())[:4]:
        assert tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True) in CHOICES
    other = {r: tuple(tiny_tokenizer("Parma")["input_ids"]) for r in alone}
    for options in (dict(reference=other), {}):
        spec = run_prompts(tiny_model_dir, params, drafter=str(tiny_random_drafter),
                    num_speculative_tokens=3, **options)  # type: ignore[arg-type]
        assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids
                                                             for r, c in alone.items()}
        assert sum(c.num_drafted for c in spec.values()) > 0
    if temperature == 0.0:
        assert {r: alone[r].token_ids for r in "0123"} == {r: guided[r].token_ids
                                                           for r in "0123"}


def test_choices_no_token_spells_fail_their_request_alone(tiny_model_dir: Path) -> None:
    params = [SamplingParams(max_tokens=4, guided_choice=("yes", "\u00e6\u00f8"))] + [
        SamplingParams(max_tokens=4, guided_choice=("yes", "no"))] * 4
    got = run_prompts(tiny_model_dir, params)
    assert got["0"].finish_reason == "error"
    assert got["0"].error == "guided choice '\u00e6\u00f8': no tokens of this vocabulary spell it"
    assert {c.finish_reason for rid, c in got.items() if rid != "0"} == {"stop"}


@pytest.mark.parametrize("kw, message", [
    (dict(guided_choice=("a", "")), "guided choices must not be empty strings"),
    (dict(guided_choice=("a",), ignore_eos=True), "not with ignore_eos"),
    (dict(guided_choice=("a",), min_tokens=2), "not with min_tokens"),
])
def test_bad_values_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_drafts_past_a_whole_choice_are_rejected(tiny_model_dir: Path,
                                                 tiny_random_drafter: Path,
                                                 guided: dict[str, Completion]) -> None:
    """Reference drafts that spell each row's choice and then go on as the unguided model
    would (its argmax after the choice): only EOS may follow the choice, so those drafts are
    rejected there, where an unmasked row would take them."""
    params = [SamplingParams(max_tokens=16, guided_choice=CHOICES)] * 5
    choice_tokens = {r: c.token_ids[:-1] for r, c in guided.items()}  # without the EOS
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                 kv_cache_memory=1 << 20))
    going_on = {c.request_id: c.token_ids for c in engine.generate(
        [GenerationRequest(r, PROMPTS[int(r)] + t, SamplingParams(max_tokens=3, ignore_eos=True))
         for r, t in choice_tokens.items()])}
    reference = {r: choice_tokens[r] + going_on[r] for r in guided}
    spec = run_prompts(tiny_model_dir, params, reference, drafter=str(tiny_random_drafter),
                num_speculative_tokens=4)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids
                                                         for r, c in guided.items()}
    # the choices' tokens after the first (which the prompt's step makes) came from drafts
    assert sum(c.num_accepted for c in spec.values()) >= sum(
        len(t) - 2 for t in choice_tokens.values())
