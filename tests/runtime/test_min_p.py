"""min_p: tokens less likely than min_p times the most likely one are dropped, after the
temperature and before top-k and top-p, as vLLM does; lossless with drafts like every filter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import sampler
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from runtime.sampler import (
    CANDIDATES,
    _sorted_vocab_probs,
    _top_k_top_p_probs,
    make_sampling_tensors,
    target_probs,
)

PROMPTS = [(5, 9, 5, 9, 5), (200, 3), (40, 41, 42, 40, 41, 42, 40), (7,), (100, 100, 100, 12)]

pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    for min_p, kept in ((0.0, 5), (0.1, 4), (0.15, 3), (0.6, 2), (1.0, 1)):
        st = make_sampling_tensors([1.0], [0], [1.0], "cpu", [min_p])
        probs = target_probs(logits, st, 1)[0, 0]
        expected = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
        expected[kept:] = 0
        torch.testing.assert_close(probs, expected / expected.sum())
    # after the temperature: at 2 the probabilities flatten and 0.2 keeps all 5
    st = make_sampling_tensors([2.0], [0], [1.0], "cpu", [0.2])
    assert (target_probs(logits, st, 1)[0, 0] > 0).sum() == 5
    # before top-k and top-p: top_p 0.8 of what min_p 0.15 leaves (0.5, 0.3, 0.1 -> 0.56, 0.33)
    st = make_sampling_tensors([1.0], [0], [0.8], "cpu", [0.15])
    assert (target_probs(logits, st, 1)[0, 0] > 0).tolist() == [True, True, False, False, False]
    assert make_sampling_tensors([1.0], [0], [1.0], "cpu", [0.0]).min_p is None


def test_min_p_rows_stay_among_the_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that min-p leaves fewer tokens than the candidates is not sent to the sort of the
    whole vocabulary (its last candidates are -inf, all tied), and keeps what that sort keeps."""
    sorted_rows: list[int] = []

    def counted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(len(scaled))
        return _sorted_vocab_probs(scaled, top_k, top_p)

    monkeypatch.setattr(sampler, "_sorted_vocab_probs", counted)
    g = torch.Generator().manual_seed(1)
    vocab = 3 * max(CANDIDATES)
    top_k = torch.tensor([[0], [20], [0], [3]])
    top_p = torch.tensor([[0.9], [1.0], [0.5], [0.95]])
    for trial in range(10):
        scaled = torch.randn(len(top_k), vocab, generator=g) * (2 + trial)
        scaled = sampler._min_p_logits(scaled, torch.full((len(top_k), 1), 0.05))
        assert ((scaled > float("-inf")).sum(-1) < min(CANDIDATES)).all()
        fast = _top_k_top_p_probs(scaled, top_k, top_p)
        assert not sorted_rows
        torch.testing.assert_close(fast, _sorted_vocab_probs(scaled, top_k, top_p), rtol=0,
                                   atol=1e-6)
        sorted_rows.clear()


def test_min_p_one_samples_the_greedy_tokens_with_and_without_drafts(
        tiny_model_dir: Path, tiny_random_drafter: Path) -> None:
    """min_p 1 keeps only the most likely token: sampling then gives greedy decoding's tokens,
    with a drafter as without; a smaller min_p samples the same with a drafter as without."""
    def run(params: SamplingParams, **options: object) -> dict[str, tuple[int, ...]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     kv_cache_memory=1 << 20, **options))  # type: ignore[arg-type]
        requests = [GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)]
        return {c.request_id: c.token_ids for c in engine.generate(requests)}

    greedy = run(SamplingParams(max_tokens=16, ignore_eos=True))
    for options in ({}, {"drafter": str(tiny_random_drafter), "num_speculative_tokens": 3}):
        assert run(SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.5, min_p=1.0),
                   **options) == greedy
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.5, min_p=0.1, seed=3)
    plain = run(sampled)
    assert plain != greedy
    assert run(sampled, drafter=str(tiny_random_drafter), num_speculative_tokens=3) == plain
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0 = off\), got 1.5"):
        SamplingParams(min_p=1.5)
