"""The drafter's KV cache under prefix caching, batching and preemption: a request drafts as it
would in a fresh engine or alone, and blocks whose drafter rows wait for a drafting step are
not lent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from tests.drafter_fixtures import make_random_drafter


@pytest.mark.parametrize(("earlier", "hit_tokens"), [((90, 91, 92), 8), ((40, 91, 92), 12)])
def test_a_prefix_hit_drafts_as_a_fresh_engine_does(
        tiny_model_dir: Path, tmp_path: Path, earlier: tuple[int, ...], hit_tokens: int) -> None:
    """The drafter's KV at a hit's last position pairs it with the token after the hit: an
    earlier request with another token there must not lend it its KV (the hit ends a block
    sooner), one with the same token may."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three blocks of 4
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(engine: Engine, request: GenerationRequest
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The drafts `request` got, and its drafter KV at the prefix's last position after
        its first step."""
        proposer = engine.runner.proposer
        assert proposer is not None
        propose, drafts, kv = proposer.propose, [], []

        def recording(step, out, *args):  # noqa: ANN001, ANN202
            proposed = propose(step, out, *args)
            for s, d in zip(out.scheduled, proposed, strict=True):
                if s.seq.request_id == request.request_id:
                    drafts.append(d)
                    block = engine.kv.block_ids(request.request_id)[11 // 4]
                    kv.extend(engine.runner.kv_caches[name][:, block, 11 % 4].clone()
                              for name in proposer.drafter.layer_names)
            return proposed

        proposer.propose = recording  # type: ignore[method-assign]
        list(engine.generate([request]))
        proposer.propose = propose  # type: ignore[method-assign]
        return drafts, kv[:2]

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False))

    x = GenerationRequest("x", tuple(prefix + [40, 41, 42]), params)
    fresh_drafts, fresh_kv = run(engine(), x)
    shared = engine()
    list(shared.generate([GenerationRequest("y", tuple(prefix + list(earlier)), params)]))
    before = shared.kv.hits_tokens
    drafts, kv = run(shared, x)
    assert shared.kv.hits_tokens - before == hit_tokens
    assert all(torch.equal(a, b) for a, b in zip(kv, fresh_kv, strict=True))
    assert drafts == fresh_drafts


def _drafts_of(engine: Engine, requests: list[GenerationRequest], request_id: str
               ) -> tuple[list[list[int]], dict[str, Completion]]:
    """Runs `requests`; the drafts proposed to `request_id` in each step, and the completions."""
    proposer = engine.runner.proposer
    assert proposer is not None
    propose, drafts = proposer.propose, []

    def recording(step, out, *args):  # noqa: ANN001, ANN202
        proposed = propose(step, out, *args)
        drafts.extend(d for s, d in zip(out.scheduled, proposed, strict=True)
                      if s.seq.request_id == request_id)
        return proposed

    proposer.propose = recording  # type: ignore[method-assign]
    done = {c.request_id: c for c in engine.generate(requests)}
    proposer.propose = propose  # type: ignore[method-assign]
    return drafts, done


def test_blocks_whose_drafter_kv_waited_for_a_drafting_step_are_not_lent(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """In steps that draft nothing (more greedy requests than draft_max_batch) the drafter's rows
    of generated tokens wait for the next step that drafts; a request that finishes (or is
    preempted) first leaves them unwritten. A later request taking its blocks from the prefix
    cache must not read that drafter KV: it drafts as a fresh engine does."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False, draft_max_batch=1))

    prompt = (11, 12, 13, 14, 15, 16)
    a = GenerationRequest("a", prompt, SamplingParams(max_tokens=14, ignore_eos=True))
    c = GenerationRequest("c", (30, 31, 32, 33, 34), SamplingParams(max_tokens=30,
                                                                    ignore_eos=True))
    shared = engine()
    done = _drafts_of(shared, [a, c], "a")[1]
    b = GenerationRequest("b", prompt + done["a"].token_ids + (40, 41),
                          SamplingParams(max_tokens=10, ignore_eos=True))
    fresh = _drafts_of(engine(), [b], "b")
    before = shared.kv.hits_tokens
    reused = _drafts_of(shared, [b], "b")
    assert shared.kv.hits_tokens - before == 4  # the prompt's first block; the rest waited
    assert reused[0] == fresh[0]
    assert reused[1]["b"].token_ids == fresh[1]["b"].token_ids


def test_drafts_do_not_depend_on_the_batch_with_preemptions(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """The drafter's KV of a request is the same whatever ran beside it, so the drafts it gets at
    a given length are the ones it gets alone, through steps that draft nothing (three greedy
    requests, draft_max_batch 1), a 3-8 token budget and preemptions that recompute it from
    blocks cached before (whose drafter rows waited in the stash)."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine(**kw: int) -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False, draft_max_batch=1, **kw))  # type: ignore[arg-type]

    def drafts_by_length(engine: Engine, requests: list[GenerationRequest]
                         ) -> dict[tuple[str, int], list[int]]:
        """(request id, its length once this step's tokens are in) -> the drafts it got."""
        proposer = engine.runner.proposer
        assert proposer is not None
        propose, seen = proposer.propose, {}

        def recording(step, out, features, emitted, verified):  # noqa: ANN001, ANN202
            proposed = propose(step, out, features, emitted, verified)
            for s, d, e in zip(out.scheduled, proposed, emitted, strict=True):
                if e is not None and d:
                    seen[(s.seq.request_id, len(s.seq.token_ids) + len(e))] = d
            return proposed

        proposer.propose = recording  # type: ignore[method-assign]
        list(engine.generate(requests))
        return seen

    g = torch.Generator().manual_seed(1)
    compared = preemptions = 0
    alone = engine(kv_cache_memory=1 << 20)  # one request at a time, prompts unlike each other
    for _ in range(4):
        lengths = torch.randint(2, 20, (3,), generator=g).tolist()
        max_tokens = torch.randint(4, 24, (3,), generator=g).tolist()
        prompts = [tuple(torch.randint(4, 250, (n,), generator=g).tolist()) for n in lengths]
        requests = [GenerationRequest(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        batched = engine(max_num_batched_tokens=int(torch.randint(3, 9, (1,), generator=g)),
                         kv_cache_memory=60_000)
        together = drafts_by_length(batched, requests)
        preemptions += batched.scheduler.num_preemptions
        for request in requests:
            own = drafts_by_length(alone, [request])
            common = [key for key in together if key in own]
            assert [together[key] for key in common] == [own[key] for key in common]
            compared += len(common)
    assert preemptions >= 2 and compared >= 15


def test_a_running_requests_blocks_whose_drafter_rows_wait_are_not_lent(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Steps where every request drafts from its n-gram lookup do not run the drafter either, so
    a running request's generated rows wait while its blocks are already cached; a request
    admitted meanwhile that extends its text must not take those blocks' drafter KV."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine(**kw: bool) -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=True, draft_max_batch=None, max_num_seqs=2,
                                   max_num_batched_tokens=8, **kw))  # type: ignore[arg-type]

    prompt = (11, 12, 13, 14, 15, 16)
    plain = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                kv_cache_memory=1 << 20))
    [first] = plain.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=40,
                                                                            ignore_eos=True))])
    w = GenerationRequest("w", prompt + first.token_ids[:8] + tuple(range(40, 50)),
                          SamplingParams(max_tokens=16, ignore_eos=True))
    requests = [GenerationRequest("p", prompt, SamplingParams(max_tokens=40, ignore_eos=True)),
                GenerationRequest("c", prompt, SamplingParams(max_tokens=10, ignore_eos=True)),
                w]
    alone = _drafts_of(engine(enable_prefix_caching=False), [w], "w")[0]
    together, done = _drafts_of(engine(), requests, "w")
    assert together[-len(alone):] == alone  # w's steps after it is admitted
    assert done["w"].token_ids == plain.generate([w]).__next__().token_ids
