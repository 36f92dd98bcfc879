"""The engine's requests end as transformers' do at max_tokens, an EOS or a stop string;
requests it cannot run fail alone, with a message, and the others finish; requests are pulled
lazily."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.config import SamplingParams
from runtime.request import GenerationRequest
from tests.runtime.engine_cases import (
    NUM_NEW,
    PROMPTS,
    TINY_BLOCK_BYTES,
    Reference,
    _engine,
    _requests,
    _run,
    one_thread,  # noqa: F401 (autouse: one torch thread for these tests)
)


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_finishes_with_length(tiny_model_dir: Path, reference: Reference,
                                         max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    completions = _run(_engine(tiny_model_dir), _requests(PROMPTS[:4], params))
    for completion in completions.values():
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == max_tokens
    assert {rid: c.token_ids for rid, c in completions.items()} == {
        f"r{i}": reference.greedy(p, max_tokens) for i, p in enumerate(PROMPTS[:4])}


def test_eos_from_generation_config_stops_like_transformers(tiny_model_dir: Path,
                                                            tmp_path: Path,
                                                            reference: Reference) -> None:
    # Make a token the model really produces an EOS (in generation_config.json, as checkpoints do)
    eos = reference.greedy(PROMPTS[8])[6]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config_file = model_dir / "generation_config.json"
    generation_config = json.loads(config_file.read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], eos]
    config_file.write_text(json.dumps(generation_config))

    engine = _engine(model_dir)
    assert eos in engine.eos_token_ids
    requests = _requests(PROMPTS, SamplingParams(max_tokens=NUM_NEW))
    completions = _run(engine, requests)
    honouring = Reference(model_dir)
    for request in requests:
        completion = completions[request.request_id]
        expected = honouring.greedy(request.prompt_token_ids, NUM_NEW, honour_eos=True)
        assert completion.token_ids == expected
        stopped = expected[-1] in engine.eos_token_ids
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert completion.stop_string is None
    assert completions["r8"].finish_reason == "stop"
    assert len(completions["r8"].token_ids) <= 7


def test_stop_string_stops_generation(tiny_model_dir: Path, reference: Reference) -> None:
    engine = _engine(tiny_model_dir)
    tokenizer = engine.tokenizer
    full = reference.greedy(PROMPTS[10])
    stop = next(text for token in full[4:]
                if (text := str(tokenizer.decode([token], skip_special_tokens=True)).strip()))
    # the first output prefix whose text contains the stop string ends the request
    end = next(n for n in range(1, NUM_NEW + 1)
               if stop in str(tokenizer.decode(list(full[:n]), skip_special_tokens=True)))
    request = GenerationRequest("stop", PROMPTS[10], SamplingParams(
        max_tokens=NUM_NEW, ignore_eos=True, stop=("never-in-this-text", stop)))
    completion = _run(engine, [request, *_requests(PROMPTS[:3])])["stop"]
    assert completion.finish_reason == "stop"
    assert completion.stop_string == stop
    assert completion.token_ids == full[:end]
    assert end < NUM_NEW


def test_bad_requests_error_and_the_others_finish(tiny_model_dir: Path,
                                                  reference: Reference) -> None:
    engine = _engine(tiny_model_dir, max_model_len=32)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    good = _requests([PROMPTS[4], PROMPTS[7]], params, prefix="good")
    near_limit = GenerationRequest("near-limit", PROMPTS[11][:29], params)
    requests = [good[0], GenerationRequest("empty", (), params),
                GenerationRequest("too-long", PROMPTS[12], params), good[1], near_limit]
    completions = _run(engine, requests)
    # 29 prompt tokens + 3 fill the 32-token context before max_tokens
    assert completions["near-limit"].finish_reason == "length"
    assert completions["near-limit"].token_ids == reference.greedy(near_limit.prompt_token_ids,
                                                                   8)[:3]

    empty, too_long = completions["empty"], completions["too-long"]
    assert empty.finish_reason == "error" and empty.token_ids == ()
    assert empty.error is not None and "empty" in empty.error
    assert too_long.finish_reason == "error" and too_long.token_ids == ()
    assert too_long.error is not None and "40 tokens" in too_long.error and "32" in too_long.error
    for request in good:
        completion = completions[request.request_id]
        assert completion.finish_reason == "length" and completion.error is None
        assert completion.token_ids == reference.greedy(request.prompt_token_ids, 8)


def test_request_too_big_for_the_kv_cache_errors(tiny_model_dir: Path,
                                                 reference: Reference) -> None:
    engine = _engine(tiny_model_dir, kv_cache_memory=6 * TINY_BLOCK_BYTES)  # 5 blocks, 20 slots
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [GenerationRequest("huge", PROMPTS[11], params),  # 31 tokens
                *_requests([PROMPTS[2], PROMPTS[5]], params)]
    completions = _run(engine, requests)
    assert completions["huge"].finish_reason == "error"
    assert completions["huge"].error == (
        "request needs up to 9 KV cache blocks of 4 tokens to finish (35 tokens of prompt and "
        "completion) but the whole cache has 5; raise --kv-cache-memory")
    # its prompt alone outgrows the cache: refused when it arrives
    assert engine.scheduler.num_preemptions == 0
    for request in requests[1:]:
        assert completions[request.request_id].token_ids == reference.greedy(
            request.prompt_token_ids, 4)
    # a prompt that fits, whose completion cannot: it fails once it runs alone out of blocks
    grows = GenerationRequest("grows", PROMPTS[11][:16], SamplingParams(max_tokens=10,
                                                                       ignore_eos=True))
    done = _run(engine, [grows])["grows"]
    assert (done.finish_reason, done.error) == ("error", (
        "request needs up to 7 KV cache blocks of 4 tokens to finish (26 tokens of prompt and "
        "completion) but the whole cache has 5; raise --kv-cache-memory"))
    # found by QA: it kept the tokens it had made, unlike every other error
    assert done.token_ids == () and done.num_drafted == 0


def test_a_request_id_already_in_flight_fails_that_request_only(
        tiny_model_dir: Path, reference: Reference) -> None:
    """Found by QA: two requests of one id shared KV blocks and corrupted each other, silently
    (the pipeline makes unique ids; the engine API did not check)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    requests = [GenerationRequest("x", PROMPTS[12], params), GenerationRequest("x", PROMPTS[4],
                                                                                 params)]
    second, first = sorted(_engine(tiny_model_dir).generate(requests),
                           key=lambda c: c.finish_reason)  # "error" before "length"
    assert (second.finish_reason, second.error, second.token_ids) == (
        "error", "request id 'x' is already in flight; ids must be unique among the requests "
                 "running at once", ())
    assert second.prompt_token_ids == PROMPTS[4]
    assert first.finish_reason == "length"
    assert first.token_ids == reference.greedy(PROMPTS[12], 6)
    # once it has finished, the id may come again
    engine = _engine(tiny_model_dir)
    for _ in range(2):
        assert [c.token_ids for c in engine.generate(requests[:1])] == [first.token_ids]


def test_prompt_ids_outside_the_vocabulary_fail_their_request_only(
        tiny_model_dir: Path, reference: Reference) -> None:
    """Found by a reviewer: an id past vocab_size (from a tokenizer's added tokens) or below 0
    raised an IndexError in the embedding, and every request of the step was lost."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [GenerationRequest("over", (5, 9, 256), params),
                GenerationRequest("under", (5, -1, 9), params), *_requests([PROMPTS[2]], params)]
    completions = _run(_engine(tiny_model_dir), requests)
    assert [(completions[i].finish_reason, completions[i].error) for i in ("over", "under")] == [
        ("error", "prompt token id 256 is outside the model's vocabulary (ids 0 to 255; a "
                  "tokenizer with tokens added beyond the model's vocab_size makes them)"),
        ("error", "prompt token id -1 is outside the model's vocabulary (ids 0 to 255)")]
    good = requests[2]
    assert completions[good.request_id].token_ids == reference.greedy(good.prompt_token_ids, 4)


def test_generate_pulls_requests_lazily(tiny_model_dir: Path) -> None:
    pulled = 0

    def requests() -> Iterator[GenerationRequest]:
        nonlocal pulled
        for i in range(50):
            pulled += 1
            yield GenerationRequest(f"lazy{i}", PROMPTS[i % 5], SamplingParams(max_tokens=2))

    engine = _engine(tiny_model_dir, max_num_seqs=2)
    completions = engine.generate(requests())
    first = next(completions)
    assert pulled < 50
    assert pulled <= 2 * engine.config.max_num_seqs  # the running batch plus a full queue
    rest = list(completions)
    assert pulled == 50
    assert sorted(c.request_id for c in [first, *rest]) == sorted(f"lazy{i}" for i in range(50))
