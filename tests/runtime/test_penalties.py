"""Repetition, frequency and presence penalties (runtime.penalties): the tokens transformers'
generate gives with its repetition penalty, the formulas of vLLM's frequency and presence
penalties, and the same tokens with drafts as without."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.penalties import penalize
from runtime.request import GenerationRequest
from runtime.sequence import Sequence
from tests.fixtures import TINY_VOCAB_SIZE

NUM_NEW = 24
# short prompts of few distinct tokens: a greedy tiny model repeats itself within 24 tokens, so
# every penalty changes the tokens
PROMPTS = [(5, 9, 5, 9, 5), (200, 3), (40, 41, 42, 40, 41, 42, 40), (7,), (100, 100, 100, 12)]
PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7),
             dict(presence_penalty=1.5),
             dict(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=0.9)]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _engine(model_dir: Path, drafter: Path | None = None, **options: object) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                               drafter=None if drafter is None else str(drafter),
                               **options))  # type: ignore[arg-type]


def _generate(engine: Engine, params: SamplingParams,
              prompts: list[tuple[int, ...]] = PROMPTS) -> dict[str, tuple[int, ...]]:
    requests = [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]
    return {c.request_id: c.token_ids for c in engine.generate(requests)}


def _reference(model: Any, prompt: tuple[int, ...], repetition_penalty: float = 1.0,
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0
               ) -> tuple[int, ...]:
    """Greedy decoding by hand, the whole sequence through the model at every step, with the
    penalties written out as vLLM documents them."""
    tokens = list(prompt)
    for _ in range(NUM_NEW):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        counts = Counter(tokens[len(prompt):])
        for token in set(tokens):
            value = logits[token]
            logits[token] = (value / repetition_penalty if value > 0
                             else value * repetition_penalty)
        for token, count in counts.items():
            logits[token] -= frequency_penalty * count
            logits[token] -= presence_penalty
        tokens.append(int(logits.argmax()))
    return tuple(tokens[len(prompt):])


def test_greedy_repetition_penalty_equals_transformers_generate(
        tiny_model_dir: Path, tiny_hf_model: Any) -> None:
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, repetition_penalty=1.3)
    got = _generate(_engine(tiny_model_dir), params)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = tiny_hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=NUM_NEW, repetition_penalty=1.3,
                                    eos_token_id=None, attention_mask=torch.ones(1, len(prompt)))
        expected[str(i)] = tuple(out[0, len(prompt):].tolist())
    assert got == expected
    plain = _generate(_engine(tiny_model_dir), SamplingParams(max_tokens=NUM_NEW,
                                                              ignore_eos=True))
    assert sum(got[k] != plain[k] for k in got) == len(PROMPTS)  # the penalty did something


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(f"{k}={v}"
                                                                        for k, v in p.items()))
def test_greedy_penalties_follow_the_formulas(tiny_model_dir: Path, tiny_hf_model: Any,
                                              penalties: dict[str, float]) -> None:
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, **penalties)
    got = _generate(_engine(tiny_model_dir), params)
    assert got == {str(i): _reference(tiny_hf_model, p, **penalties) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("penalties", PENALTIES[1:], ids=lambda p: ",".join(
    f"{k}={v}" for k, v in p.items()))
def test_penalized_requests_give_the_same_tokens_with_accepted_drafts(
        tiny_model_dir: Path, tiny_random_drafter: Path, penalties: dict[str, float]) -> None:
    """Drafts the target accepts count among the tokens before the positions they precede: a
    reference drafter (its drafts are the penalized output itself, so all are accepted) and one
    whose reference goes wrong halfway give the tokens of plain decoding, greedy and seeded."""
    for sampling in (dict(), dict(temperature=0.9, top_p=0.95, seed=11)):
        params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, **sampling, **penalties)
        plain = _generate(_engine(tiny_model_dir), params)
        spec = _engine(tiny_model_dir, tiny_random_drafter, num_speculative_tokens=3,
                       max_num_seqs=2)
        half = NUM_NEW // 2
        wrong_halfway = {k: v[:half] + tuple((t + 1) % TINY_VOCAB_SIZE for t in v[half:])
                         for k, v in plain.items() if k != "0"}
        spec.draft_from_reference({"0": plain["0"], **wrong_halfway})
        requests = [GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)]
        completions = {c.request_id: c for c in spec.generate(requests)}
        assert {k: c.token_ids for k, c in completions.items()} == plain
        # request 0's drafts were all accepted: several per step, each penalizing the next
        assert completions["0"].num_accepted == completions["0"].num_drafted > NUM_NEW // 2


def test_penalized_rows_next_to_plain_rows_with_a_random_drafter(
        tiny_model_dir: Path, tiny_random_drafter: Path) -> None:
    """A batch mixing penalized and plain, greedy and sampled requests: each gets its tokens
    alone without a drafter."""
    mixed = [SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, repetition_penalty=1.2),
             SamplingParams(max_tokens=NUM_NEW, ignore_eos=True),
             SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, temperature=0.7, seed=3,
                            presence_penalty=0.5),
             SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, temperature=0.7, seed=4),
             SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, frequency_penalty=1.0)]
    requests = [GenerationRequest(str(i), p, s) for i, (p, s) in enumerate(
        zip(PROMPTS, mixed, strict=True))]
    alone = {}
    for r in requests:
        alone.update({c.request_id: c.token_ids for c in _engine(tiny_model_dir).generate([r])})
    for draft in ({"drafter": tiny_random_drafter, "num_speculative_tokens": 4},
                  {"draft_ngram": True, "num_speculative_tokens": 3}):
        engine = _engine(tiny_model_dir, **draft)  # type: ignore[arg-type]
        assert {c.request_id: c.token_ids for c in engine.generate(requests)} == alone


def test_penalize_counts_prompt_outputs_and_the_drafts_before_each_position() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    seq = Sequence("r", [1, 1, 2], params, arrival=0, num_speculative_tokens=2)
    seq.token_ids += [3, 3]  # outputs
    plain = Sequence("p", [1, 4], SamplingParams(), arrival=0, num_speculative_tokens=2)
    logits = torch.tensor([[1.0, 4.0, -4.0, 8.0, 2.0, 6.0]]).repeat(4, 1)
    penalize(logits, [plain, seq], [[], [4, 3]])
    # row 0 is the plain request's; row 1 (seq's first position): prompt tokens 1, 2
    # (repetition only), outputs 3 twice; row 2 also has the draft 4 before it; row 3 the
    # drafts 4 and 3
    untouched = [1.0, 4.0, -4.0, 8.0, 2.0, 6.0]
    before_draft = [1.0, 2.0, -8.0, 4.0 - 1.0 - 0.25, 2.0, 6.0]
    after_one = before_draft[:4] + [1.0 - 0.5 - 0.25, 6.0]
    after_two = before_draft[:3] + [4.0 - 1.5 - 0.25] + after_one[4:]
    assert logits.tolist() == [untouched, before_draft, after_one, after_two]


def test_sampling_params_refuse_out_of_range_penalties() -> None:
    for bad, message in ((dict(repetition_penalty=0.0), r"repetition_penalty must be in "
                          r"\[0.01, 100\] \(1 = off\), got 0.0"),
                         (dict(repetition_penalty=1e-38), "repetition_penalty must be in"),
                         (dict(repetition_penalty=101.0), "repetition_penalty must be in"),
                         (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                         (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
                         (dict(presence_penalty=float("nan")), "presence_penalty must be in")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert not SamplingParams(repetition_penalty=1, frequency_penalty=0).penalized
