"""Generate stage: a thin adapter from prepared rows to engine requests and back.

Request ids are "<row>:<sample>" (row = index within the shard), so a completion finds its row
whatever order the engine finishes in. With n > 1 every sample gets its own seed, derived from
(row seed or job seed, row id, sample index): a rerun, or a resumed shard, draws the same samples.
With n = 1 so does every row under a job seed (rows would otherwise share one seed: the same
prompt twice, the same sample, and other prompts the same uniforms at each position); a row's own
seed is used as given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from pipeline.stages.tokenize import PreparedRow
from runtime.config import SamplingParams
from runtime.request import Completion, GenerationRequest


class EngineLike(Protocol):
    """What the pipeline uses of runtime.engine.Engine."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    model_context: int  # the model's own context, which max_model_len may exceed
    model_name: str
    vocab_size: int
    unapplied_generation_config: list[str]

    def guided_problem(self, params: SamplingParams) -> str | None: ...

    def generate(self, requests: Iterable[GenerationRequest],
                 on_step: Callable[[int], None] | None = None) -> Iterator[Completion]: ...


class SampleResult(NamedTuple):
    row: int  # index within the shard
    sample: int
    completion: Completion


def sample_seed(base: int | None, row_id: str, sample_index: int) -> int:
    """A 63-bit seed that depends only on its arguments (not on the process or the batch)."""
    digest = hashlib.blake2b(f"{base}\x00{row_id}\x00{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def build_requests(prepared: Sequence[PreparedRow], row_ids: Sequence[str],
                   n: int) -> Iterator[GenerationRequest]:
    """Lazily, n requests per good row (error rows make none), in row order."""
    for row, (item, row_id) in enumerate(zip(prepared, row_ids, strict=True)):
        if item.error is not None:
            continue
        assert item.prompt_token_ids is not None and item.params is not None
        for sample in range(n):
            params = item.params
            if n > 1 or (params.seed is not None and not item.row_seed):
                params = replace(params, seed=sample_seed(params.seed, row_id, sample))
            yield GenerationRequest(f"{row}:{sample}", item.prompt_token_ids, params)


def generate_rows(engine: EngineLike, prepared: Sequence[PreparedRow], row_ids: Sequence[str],
                  n: int, on_step: Callable[[int], None] | None = None) -> Iterator[SampleResult]:
    """Feed the rows' requests to the engine lazily; yield results as they finish (any order)."""
    for completion in engine.generate(build_requests(prepared, row_ids, n), on_step=on_step):
        row, sample = completion.request_id.split(":")
        yield SampleResult(int(row), int(sample), completion)
