"""Mutable per-request state, owned by the scheduler and updated after each step."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Hashable
from typing import Any

from runtime.config import SamplingParams
from runtime.request import TopLogprobs
from runtime.speculative.ngram import NgramIndex


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """token_ids holds the prompt and every verified output token. num_computed_tokens counts the
    tokens whose KV is in the cache; after a decode step it is len(token_ids) - 1 (the newest
    token is fed in the next step). draft_token_ids are proposals to verify in the next step."""

    __slots__ = ("request_id", "params", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "draft_token_ids", "status", "finish_reason", "stop_string", "arrival",
                 "num_drafted", "num_accepted", "num_draft_steps",
                 "accepted_per_position", "num_preemptions", "ngram_index", "may_draft",
                 "output_logprobs", "output_top_logprobs", "prompt_logprobs",
                 "prompt_tokens_seen", "guide_state")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, num_speculative_tokens: int) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.draft_token_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.arrival = arrival
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_draft_steps = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        self.num_preemptions = 0
        self.ngram_index: NgramIndex | None = None  # n-gram lookup drafts, built on first use
        # False for a step in which the scheduler found the request room for its tokens but not
        # for drafts (alone, at the edge of the KV cache): it drafts nothing after that step
        self.may_draft = True
        # with params.logprobs / top_logprobs: one per output token (SamplingParams.logprobs,
        # top_logprobs); the first is filled for either
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        # with params.prompt_logprobs: those of prompt tokens 1, 2, ... so far (the first has
        # none); kept through preemption
        self.prompt_logprobs: list[float] = []
        # the prompt's distinct tokens (a set and an array), made by runtime.penalties
        self.prompt_tokens_seen: tuple[frozenset[int], array[int]] | None = None
        # guided decoding (runtime.guided): (its guide, outputs read, the state after them)
        self.guide_state: tuple[Any, int, Hashable | None] | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt log-probabilities and has not all of them yet: its prompt is
        computed from the start, without prefix-cache hits."""
        return (self.params.prompt_logprobs
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_with_drafts(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    def reset_for_recompute(self) -> None:
        """Preemption: the KV is dropped; outputs so far are kept and recomputed as prompt."""
        self.num_computed_tokens = 0
        self.draft_token_ids = []
        self.status = Status.WAITING
        self.num_preemptions += 1
