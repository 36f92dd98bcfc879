"""The engine end to end on real model code: its greedy output equals transformers' `generate`
on each prompt alone, token for token, whatever the batching, chunking, preemption or prefix
caching; sampling, stop conditions, errors and lazy request pulling."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest

BLOCK_SIZE = 4
# The tiny llama's KV block: 2 layers * (K and V) * 4 slots * 2 KV heads * 16 dims * 4 bytes
TINY_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
LARGE_CACHE = 256 * TINY_BLOCK_BYTES
NUM_NEW = 16
PROMPT_LENGTHS = (1, 2, 3, 4, 5, 7, 9, 12, 16, 17, 23, 31, 40)
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(4, 256, (length,), generator=generator).tolist())


PROMPTS = [_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


def _engine(model_dir: Path, **options: object) -> Engine:
    settings: dict[str, object] = {
        "model": str(model_dir), "device": "cpu", "dtype": "float32",
        "attention_backend": "torch", "block_size": BLOCK_SIZE, "kv_cache_memory": LARGE_CACHE}
    settings.update(options)
    return Engine(EngineConfig(**settings))  # type: ignore[arg-type]


def _requests(prompts: list[tuple[int, ...]], params: SamplingParams = GREEDY,
              prefix: str = "r") -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def _run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, Completion]:
    completions = {c.request_id: c for c in engine.generate(requests)}
    assert sorted(completions) == sorted(r.request_id for r in requests)
    return completions


def _tokens(completions: dict[str, Completion]) -> dict[str, tuple[int, ...]]:
    return {rid: c.token_ids for rid, c in completions.items()}


class Reference:
    """transformers' greedy generate on one prompt at a time, memoized."""

    def __init__(self, model_dir: Path) -> None:
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple[tuple[int, ...], int, bool], tuple[int, ...]] = {}

    def greedy(self, prompt: tuple[int, ...], max_new_tokens: int = NUM_NEW,
               honour_eos: bool = False) -> tuple[int, ...]:
        key = (prompt, max_new_tokens, honour_eos)
        if key not in self._memo:
            # eos_token_id=None: generate exactly max_new_tokens (the engine's ignore_eos)
            eos = {} if honour_eos else {"eos_token_id": None}
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=max_new_tokens,
                                          attention_mask=torch.ones(1, len(prompt)), **eos)
            self._memo[key] = tuple(out[0, len(prompt):].tolist())
        return self._memo[key]

    def expected(self, requests: list[GenerationRequest]) -> dict[str, tuple[int, ...]]:
        return {r.request_id: self.greedy(r.prompt_token_ids, r.params.max_tokens)
                for r in requests}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: these models are small, and on a busy 2-core machine a second thread
    costs far more in synchronization than it gains (SmolLM2's 32 tokens: 5 s vs 33 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def large_cache_outputs(tiny_model_dir: Path) -> dict[str, tuple[int, ...]]:
    return _tokens(_run(_engine(tiny_model_dir), _requests(PROMPTS)))


def test_greedy_batch_equals_transformers_on_each_prompt(
        tiny_model_dir: Path, reference: Reference,
        large_cache_outputs: dict[str, tuple[int, ...]]) -> None:
    requests = _requests(PROMPTS)
    completions = _run(_engine(tiny_model_dir), requests)
    assert _tokens(completions) == reference.expected(requests)
    assert _tokens(completions) == large_cache_outputs
    for request in requests:
        completion = completions[request.request_id]
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == NUM_NEW
        assert completion.prompt_token_ids == request.prompt_token_ids
        assert completion.error is None and completion.stop_string is None


def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir: Path, reference: Reference
                                               ) -> None:
    requests = _requests(PROMPTS)
    engine = _engine(tiny_model_dir, max_num_batched_tokens=7)  # cuts prompts of 8+ tokens
    assert _tokens(_run(engine, requests)) == reference.expected(requests)


def test_a_prompt_cut_into_other_chunks_gives_bit_equal_greedy_tokens(
        tiny_model_dir: Path) -> None:
    """On the cpu backend every prompt chunk goes through the attention kernel, which computes
    each query alone, so greedy tokens do not depend on the cut (the token budget, which a
    drafter's verification rows change). This prompt, found by a randomized check, has a
    near-tie that flipped when its 28 tokens took torch's SDPA in one chunk (budget 2048: 160
    at the 8th token, where chunks of at most 17 gave 82). The tokens themselves depend on the
    machine's vector instructions (the AVX-512 and AVX2 kernels round differently), so the check
    is that every cut gives the same ones."""
    prompt = (19, 153, 119, 231, 138, 136, 5, 208, 229, 228, 14, 174, 23, 207, 8, 104, 79, 187,
              144, 226, 201, 217, 98, 100, 48, 225, 204, 78)
    request = GenerationRequest("x", prompt, SamplingParams(max_tokens=13, ignore_eos=True))
    outputs = set()
    for budget in (2048, 9, 16, 17):
        engine = _engine(tiny_model_dir, attention_backend="cpu", max_num_batched_tokens=budget)
        outputs.add(_run(engine, [request])["x"].token_ids)
    assert len(outputs) == 1 and len(next(iter(outputs))) == 13, outputs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_small_kv_cache_preempts_and_still_gives_the_same_tokens(
        tiny_model_dir: Path, large_cache_outputs: dict[str, tuple[int, ...]],
        prefix_caching: bool) -> None:
    # 14 usable blocks = 56 slots: the longest request (40 + 16 tokens) just fits alone
    engine = _engine(tiny_model_dir, kv_cache_memory=15 * TINY_BLOCK_BYTES,
                     enable_prefix_caching=prefix_caching)
    assert engine.kv_cache_config.num_blocks == 15
    completions = _run(engine, _requests(PROMPTS))
    assert engine.scheduler.num_preemptions > 0
    assert _tokens(completions) == large_cache_outputs
    assert {c.finish_reason for c in completions.values()} == {"length"}


def test_prefix_caching_reuses_blocks_and_keeps_the_tokens(tiny_model_dir: Path,
                                                           reference: Reference) -> None:
    shared = _prompt(26, seed=100)
    prompts = [shared + _prompt(3, seed=101), shared + _prompt(9, seed=102)]
    together = _requests(prompts, prefix="together")
    one_by_one = _requests(prompts, prefix="later")
    expected = {**reference.expected(together), **reference.expected(one_by_one)}

    uncached = _engine(tiny_model_dir, enable_prefix_caching=False)
    outputs = {**_tokens(_run(uncached, together)), **_tokens(_run(uncached, one_by_one))}
    assert uncached.kv.hits_tokens == 0
    assert outputs == expected

    cached = _engine(tiny_model_dir)
    outputs = _tokens(_run(cached, together))  # the second hits blocks the first fills
    hits_together = cached.kv.hits_tokens
    assert hits_together == 24  # 6 full blocks of the shared 26 tokens
    for request in one_by_one:  # each alone, after the first ran: the cache outlives requests
        outputs.update(_tokens(_run(cached, [request])))
    assert cached.kv.hits_tokens > hits_together
    assert outputs == expected


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_model_dir: Path,
                                                          reference: Reference) -> None:
    sampled = SamplingParams(max_tokens=NUM_NEW, temperature=0.8, top_p=0.9, seed=1234,
                             ignore_eos=True)
    target = GenerationRequest("target", PROMPTS[6], sampled)
    alone = _run(_engine(tiny_model_dir), [target])["target"].token_ids

    others = _requests(PROMPTS[:6] + PROMPTS[7:], prefix="greedy")
    others += [GenerationRequest("other-seed", PROMPTS[3], SamplingParams(
        max_tokens=NUM_NEW, temperature=1.0, seed=7, ignore_eos=True))]
    others += [GenerationRequest("unseeded", PROMPTS[9], SamplingParams(
        max_tokens=NUM_NEW, temperature=1.0, top_k=20, ignore_eos=True))]
    batch = others[:5] + [target] + others[5:]
    engine = _engine(tiny_model_dir, max_num_batched_tokens=16)
    completions = _run(engine, batch)
    assert completions["target"].token_ids == alone
    # preempted and recomputed, the request still draws the same tokens
    small = _engine(tiny_model_dir, kv_cache_memory=15 * TINY_BLOCK_BYTES)
    assert _run(small, batch)["target"].token_ids == alone
    assert small.scheduler.num_preemptions > 0
    assert len(alone) == NUM_NEW
    # greedy neighbours are unaffected by the samplers next to them
    greedy = [r for r in batch if r.request_id.startswith("greedy")]
    assert {r.request_id: completions[r.request_id].token_ids for r in greedy} == \
        reference.expected(greedy)
    # sampling really samples: another seed takes another path
    reseeded = GenerationRequest("reseeded", PROMPTS[6], SamplingParams(
        max_tokens=NUM_NEW, temperature=0.8, top_p=0.9, seed=4321, ignore_eos=True))
    assert _run(_engine(tiny_model_dir), [reseeded])["reseeded"].token_ids != alone


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


CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then give one everyday example of "
    "light scattering that a child could observe at home.",
)


@pytest.mark.slow
def test_smollm2_greedy_batch_equals_transformers(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = []
    for text in CHAT_PROMPTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tuple(tokenizer(chat, add_special_tokens=False).input_ids))
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32",
                                 attention_backend="torch", kv_cache_memory=64 << 20))
    requests = _requests(prompts, params)
    completions = _run(engine, requests)
    expected = Reference(smollm2_dir).expected(requests)
    assert _tokens(completions) == expected
