"""Confidence-gated drafting: each request's drafts stop where the drafter's probability of the
drafts so far falls below EngineConfig.draft_confidence; outputs stay exactly the target's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import random_prompt_requests

K = 3
SHARPEN = 5.0
PROMPT_LENGTHS = (5, 13, 1, 20, 8, 22)


def _requests() -> list[GenerationRequest]:
    return random_prompt_requests(PROMPT_LENGTHS, SamplingParams(max_tokens=24, ignore_eos=True),
                                  seed=0)


def _engine(model_dir: Path, drafter: Path, gate: float, max_num_seqs: int = 64) -> Engine:
    """A random drafter's distributions are nearly flat; its head's norm is scaled up so that
    its confidence varies from draft to draft the way a trained drafter's does."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=str(drafter), num_speculative_tokens=K,
                                 draft_confidence=gate, max_num_seqs=max_num_seqs))
    assert engine.proposer is not None
    with torch.no_grad():
        engine.proposer.drafter.norm.weight.mul_(SHARPEN)
    return engine


def _record(engine: Engine) -> list[dict[str, Any]]:
    """Wraps the engine's own proposer and drafter to record, per propose call, the drafter's
    probabilities of each draft step and the drafts it returned."""
    proposer = engine.proposer
    assert proposer is not None
    calls: list[dict[str, Any]] = []
    draft, propose = proposer.drafter.draft_with_confidence, proposer.propose

    def recording_draft(hidden: torch.Tensor, confidence: bool = True) -> Any:
        tokens, prob = draft(hidden, confidence)
        calls[-1]["probs"].append(prob)
        return tokens, prob

    def recording_propose(step: Any, out: Any, features: Any, emitted: list[Any],
                          verified: list[int]) -> list[list[int]]:
        calls.append({"probs": []})
        drafts = propose(step, out, features, emitted, verified)
        calls[-1]["sampling"] = [i for i, e in enumerate(emitted) if e is not None]
        calls[-1]["drafts"] = drafts
        return drafts

    proposer.drafter.draft_with_confidence = recording_draft  # type: ignore[method-assign]
    proposer.propose = recording_propose  # type: ignore[method-assign]
    return calls


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("gated"), num_layers=2,
                               style="eagle3", draft_vocab_size=100, aux_layer_ids=(0, 1, 1))


@pytest.fixture(scope="module")
def gate(tiny_model_dir: Path, drafter: Path) -> float:
    """A gate between the least likely first draft and the likeliest pair of first two drafts
    (from an ungated run), so it cuts some requests' drafts to none and keeps two for others."""
    engine = _engine(tiny_model_dir, drafter, 1e-9)  # > 0: probabilities are computed
    calls = _record(engine)
    list(engine.generate(_requests()))
    chains = torch.cat([torch.stack(c["probs"], dim=1).cumprod(dim=1)
                        for c in calls if len(c["sampling"]) > 1])
    lowest_first, highest_pair = chains[:, 0].min().item(), chains[:, 1].max().item()
    assert lowest_first < highest_pair
    return (lowest_first + highest_pair) / 2


def test_drafts_stop_where_the_chain_probability_falls_below_the_gate(
        tiny_model_dir: Path, drafter: Path, gate: float) -> None:
    engine = _engine(tiny_model_dir, drafter, gate)
    calls = _record(engine)
    list(engine.generate(_requests()))
    lengths = []
    for call in calls:
        if len(call["sampling"]) < 2:  # alone: no cut (the test below); none: no drafts
            continue
        chain = torch.stack(call["probs"], dim=1).cumprod(dim=1)  # [sampling, steps run]
        want = (chain >= gate).sum(dim=1).tolist()
        got = [len(call["drafts"][i]) for i in call["sampling"]]
        assert got == want
        # draft steps stop early only when every chain has fallen below the gate
        assert len(call["probs"]) == K or all(n < len(call["probs"]) for n in got)
        lengths += got
    assert 0 in lengths and max(lengths) >= 2  # the gate both cut drafts and kept chains


def test_gated_drafting_is_lossless_and_drafts_less(tiny_model_dir: Path, drafter: Path,
                                                    gate: float) -> None:
    plain = {c.request_id: c for c in Engine(EngineConfig(
        model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20)).generate(_requests())}
    full = {c.request_id: c for c in _engine(tiny_model_dir, drafter, 0.0).generate(_requests())}
    gated = {c.request_id: c for c in _engine(tiny_model_dir, drafter, gate).generate(_requests())}
    assert {k: c.token_ids for k, c in gated.items()} == {k: c.token_ids for k, c in plain.items()}
    assert {k: c.token_ids for k, c in full.items()} == {k: c.token_ids for k, c in plain.items()}
    drafted_full = sum(c.num_drafted for c in full.values())
    drafted_gated = sum(c.num_drafted for c in gated.values())
    assert 0 < drafted_gated < drafted_full


def test_a_greedy_request_alone_verifies_every_draft_it_drafts(tiny_model_dir: Path,
                                                               drafter: Path, gate: float) -> None:
    """At batch 1 the gate does not cut drafts from verification (a few more rows cost next to
    nothing there), but it still ends the draft steps: the drafter stops after the first draft
    whose chain probability falls below the gate, and that draft is verified too. The tokens
    are the target's."""
    engine = _engine(tiny_model_dir, drafter, gate, max_num_seqs=1)
    calls = _record(engine)
    alone = {c.request_id: c for c in engine.generate(_requests())}
    drafting = [c for c in calls if c["sampling"]]
    assert drafting and all(len(c["sampling"]) == 1 for c in drafting)
    lengths = []
    for call in drafting:
        chain = torch.stack(call["probs"], dim=1).cumprod(dim=1)[0].tolist()  # [steps run]
        below = [j for j, p in enumerate(chain) if p < gate]
        assert len(chain) == (below[0] + 1 if below else K)  # the steps end at the first
        assert len(call["drafts"][call["sampling"][0]]) == len(chain)  # ... all verified
        lengths.append(len(chain))
    assert 1 in lengths and K in lengths  # some steps stopped early, some ran all K
    plain = {c.request_id: c for c in Engine(EngineConfig(
        model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20)).generate(_requests())}
    assert {k: c.token_ids for k, c in alone.items()} == {k: c.token_ids for k, c in plain.items()}


def test_draft_confidence_must_be_a_probability_below_one() -> None:
    with pytest.raises(ValueError, match="draft_confidence"):
        EngineConfig(draft_confidence=1.0)
    with pytest.raises(ValueError, match="draft_confidence"):
        EngineConfig(draft_confidence=-0.1)
