"""Messages in and out of the engine: what the pipeline sends and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.config import SamplingParams

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized. request_id must be unique among requests in flight."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Completion:
    """The finished result of one request.

    finish_reason: "stop" (EOS or a stop string), "length" (max_tokens or the context limit),
    "error" (the request could not run: empty prompt, too long for the context or the KV cache).
    stop_string: the stop string that ended generation, if any; token_ids still hold the tokens
    that produced it, and the detokenizer cuts the text at its first occurrence.
    num_drafted / num_accepted: speculative decoding counts for this request (0 without drafter).
    accepted_per_position: how many draft tokens were accepted at position 0, 1, ... k-1 (and
        further, up to draft_ngram_tokens, where a long n-gram lookup got past k).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_string: str | None = None
    # with stop_string: the first tokens whose text it may not end in (min_tokens held it back),
    # so the text is cut at its first occurrence that ends after theirs
    stop_held_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_draft_steps: int = 0
    accepted_per_position: tuple[int, ...] = ()
    error: str | None = None  # set when finish_reason == "error": why the request could not run
    # with SamplingParams.logprobs: each token's log-probability, one per token_ids entry
    logprobs: tuple[float, ...] | None = None
    # with SamplingParams.top_logprobs: for each token, the most likely tokens where it was drawn,
    # as (token id, log-probability) pairs, most likely first (lowest id first among equals)
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    # with SamplingParams.prompt_logprobs: each prompt token's log-probability given those
    # before it, for prompt tokens 1, 2, ... (len(prompt_token_ids) - 1 values)
    prompt_logprobs: tuple[float, ...] | None = None
