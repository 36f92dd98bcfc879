"""Frozen configuration for the engine and for sampling.

Everything a user can set on the command line ends up in one of these two dataclasses; the
pipeline builds them, the engine only reads them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

from runtime.json_schema import schema_regex
from runtime.regex_parse import parse

DEFAULT_MODEL = "smollm2-135m-instruct"

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4,
          "TB": 1000**4, "TIB": 1024**4}


def parse_memory_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000' -> 1000 bytes."""
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; use e.g. 2GiB, 512MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


class PlacementError(ValueError):
    """The engine cannot run where it was asked to (a device, or an attention backend, that
    this machine lacks); the message names the option."""


# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (1e-40 gave every token infinite weight), and its distribution is the argmax's anyway.
GREEDY_BELOW = 1e-5


MAX_TOP_K = 2**31 - 1  # (a top-k at or above the vocabulary's size is no cut at all)
# Beyond it a float32 logit divided by it overflows (1e-38 made every seen token +inf), and a
# logit of 0 times it is NaN; useful values lie around 1-1.5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as in OpenAI's API and vLLM
MAX_TOP_LOGPROBS = 20  # as OpenAI's API and vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as in OpenAI's API
MAX_DRAFT_TOKENS = 32  # k: a verification of more rows costs more than drafts save anywhere


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. temperature 0 (or below GREEDY_BELOW) means greedy; top_k == 0
    means no top-k."""

    max_tokens: int = 256
    min_tokens: int = 0  # EOS is held back (its logits -inf) until this many tokens (0 = off)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # token ids that end the request as EOS does (also with ignore_eos; held back by min_tokens)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # runtime.penalties: 1 / 0 / 0 are off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Completion.logprobs: each generated token's log-probability under the model's own
    # distribution (the log-softmax of its logits, before penalties, temperature, top-k, top-p)
    logprobs: bool = False
    # Completion.top_logprobs: for each generated token, the top_logprobs most likely tokens of
    # that distribution and their log-probabilities (0 = off)
    top_logprobs: int = 0
    # Completion.prompt_logprobs: each prompt token's log-probability given the tokens before
    # it (the first has none). The prompt is then computed whole, without prefix-cache hits.
    prompt_logprobs: bool = False
    # runtime.token_bias: only these tokens may be generated (vLLM's allowed_token_ids; () = all)
    allowed_token_ids: tuple[int, ...] = ()
    # runtime.token_bias: (token id, bias) pairs added to those tokens' logits (vLLM's and
    # OpenAI's logit_bias), each id once
    logit_bias: tuple[tuple[int, float], ...] = ()
    # runtime.guided: the completion is one of these strings, then EOS (vLLM's guided_choice)
    guided_choice: tuple[str, ...] = ()
    # runtime.guided: the completion matches this pattern whole, then EOS (vLLM's guided_regex;
    # runtime.regex_dfa's syntax)
    guided_regex: str | None = None
    # runtime.guided: the completion is JSON that a JSON schema (this text) allows, then EOS
    # (vLLM's guided_json; runtime.json_schema reads it)
    guided_json: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k} (one at or "
                             "above the vocabulary's size samples from all of it)")
        if not 0 <= self.min_p <= 1:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids must be >= 0, got {min(self.stop_token_ids)}")
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError(f"allowed token ids must be >= 0, got {min(self.allowed_token_ids)}")
        self._check_logit_bias()
        self._check_guided()
        if not all(self.stop):
            raise ValueError("stop strings must not be empty (one would end every completion "
                             "at its first token)")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (0 = off), got "
                             f"{self.top_logprobs}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN fails too
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), got "
                             f"{self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] "
                                 f"(0 = off), got {value}")

    def _check_logit_bias(self) -> None:
        ids = [t for t, _ in self.logit_bias]
        if any(t < 0 for t in ids):
            raise ValueError(f"logit_bias token ids must be >= 0, got {min(ids)}")
        if len(set(ids)) < len(ids):
            twice = next(t for t in ids if ids.count(t) > 1)
            raise ValueError(f"logit_bias gives token {twice} more than one bias")
        for t, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias of token {t} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")

    def _check_guided(self) -> None:
        given = [name for name in ("guided_choice", "guided_regex", "guided_json")
                 if getattr(self, name) not in ((), None)]
        if not given:
            return
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give one of them")
        if self.allowed_token_ids:  # the two masks could leave no token at all
            raise ValueError(f"{given[0]} and allowed_token_ids: give one of them")
        if not all(self.guided_choice):
            raise ValueError("guided choices must not be empty strings")
        if self.guided_regex == "" or self.guided_json == "":
            raise ValueError(f"a {given[0].replace('_', ' ')} must not be empty")
        guided_pattern(self)  # a ValueError names where the pattern or schema cannot be read
        what = given[0].replace("_", " ")
        # a completion that is a whole choice (a whole match) may have to go on to EOS
        if self.ignore_eos:
            raise ValueError(f"{what} ends a completion at EOS: not with ignore_eos")
        if self.min_tokens:
            raise ValueError(f"{what} ends a completion at EOS: not with min_tokens")

    @property
    def guided(self) -> bool:
        """guided_choice, guided_regex or guided_json (runtime.guided) constrain it."""
        return (bool(self.guided_choice) or self.guided_regex is not None
                or self.guided_json is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def wants_logprobs(self) -> bool:
        """Log-probabilities of some kind are asked for: the whole head's logits are needed."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def biased(self) -> bool:
        """allowed_token_ids or logit_bias change its logits (runtime.token_bias)."""
        return bool(self.allowed_token_ids or self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Some penalty applies (runtime.penalties): the logits change with the tokens so far."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


# `eaglebatch generate` and `bench` default for EngineConfig.draft_confidence (measured with the
# shipped drafter: batch 16, k = 2, 94 -> 103 tokens/s; no change at batch 1)
CLI_DRAFT_CONFIDENCE = 0.15
# `eaglebatch generate` default for EngineConfig.draft_max_batch: with the shipped drafter on the
# 2-core CPU, k = 2 gains 1.30x at batch 1 and 1.07x at 4, but loses at 8 (0.98x), 16 (0.88x)
# and 64 (0.74x)
CLI_DRAFT_MAX_BATCH = 4
# `eaglebatch generate` and `bench` default for EngineConfig.draft_ngram_tokens. Batch 1, 2 threads,
# k = 2, 8 prompts: 1.74 tokens per step with lookups of up to k, 1.84 up to 4, 1.86 up to 6; but
# verifying 5 or more rows costs more (panel_linear's tiles of 5-6 rows stream memory slower than
# those of up to 4; 16 prompts, request by request: 5-row steps +1.3 ms, 7-row steps +1.8 ms over
# 3 rows), and up to 3 (4 rows) gave the most tokens/s: 87.7 against 84.0 (6) and 85.5 (k))
CLI_DRAFT_NGRAM_TOKENS = 3


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an Engine.

    model: a built-in name (DEFAULT_MODEL), a Hugging Face checkpoint directory or a .gguf file.
    drafter: an EAGLE drafter checkpoint directory, or None for no speculation.
    kv_cache_memory: bytes for the KV cache; None = a default (CPU: 1 GiB, GPU: 80% of free memory).
    draft_confidence: a request's drafts stop at the first one where the drafter's probability of
        the drafts so far (the product over them) falls below this, so verification spends less on
        drafts that would likely be rejected, and the draft steps end once every request's has;
        0 keeps all k. In a step where one greedy request samples alone that last draft is
        verified too (extra rows cost it almost nothing; another draft step does cost: batch 1,
        2 threads, k = 3: 1.50x -> 1.55x). Outputs are the same either way.
    draft_max_batch: requests get no drafts in a step with more than this many requests
        sampling (where verifying drafts costs more than it saves); None drafts at any batch.
        Such steps do not run the drafter at all: the target features of their positions are
        kept (one feature vector per token) and the drafter reads them in the next step that
        drafts, as the batch drains. Outputs are the same either way, greedy or seeded (a
        seeded token is the target's draw at a uniform its seed and place fix).
    draft_int8: on the CPU (with the C++ kernels), run the drafter's float32 products on int8
        copies of its weights (one scale per output): a draft step reads a quarter of the bytes.
        Drafts may differ slightly (runtime.cpu_gemm); outputs are the same either way.
    q4_panels: on the CPU (with the C++ kernels), give every target product whose float32
        weights are all exactly GGUF Q4_1 values (fma(d, q, m), one d and m per 32 inputs: the
        default model's decoder) 4-bit panels for steps of up to 12 rows: the same bits, 3/16 of
        the bytes (runtime.weight_panels.q4_panels). Outputs are the same either way.
    draft_ngram: where a request's last 2-4 tokens occurred before in its prompt or output, draft
        the (up to k) tokens that followed them instead of the drafter's drafts
        (runtime.speculative.ngram). Greedy outputs are the same either way.
    draft_ngram_tokens: with draft_ngram, a greedy request that samples alone in its step may
        draft up to this many tokens from its lookup, more than k (verifying up to 4 rows costs
        such a step almost nothing on the CPU; the drafter still drafts k). 0, or at most k: k.
        The engine then verifies up to draft_width tokens per request and step.
    cuda_graphs: on CUDA with the torch attention backend, replay the target's pure decode steps
        (one token per request, no drafts) from CUDA graphs, one per bucket of batch size and
        context length (runtime.cuda_graphs). Off by default: not yet measured on a GPU.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context (runtime.rope.context_length)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | cpu | flash
    drafter: str | None = None
    num_speculative_tokens: int = 3
    draft_confidence: float = 0.0  # 0: always k drafts; see the docstring
    draft_max_batch: int | None = None  # None: draft at any batch size; see the docstring
    draft_int8: bool = False  # CPU: the drafter's products on int8 weights; see the docstring
    q4_panels: bool = False  # CPU: 4-bit panels where the weights are exactly Q4_1; see docstring
    draft_ngram: bool = False  # n-gram lookup drafts where the text repeats; see the docstring
    draft_ngram_tokens: int = 0  # lookup drafts of a lone greedy request; see the docstring
    cuda_graphs: bool = False  # CUDA: decode steps replayed from graphs; see the docstring
    gpu_memory_fraction: float = 0.8
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    extra: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "flash"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or flash, "
                             f"got {self.attention_backend!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_ngram_tokens < 0:
            raise ValueError(f"draft_ngram_tokens must be >= 0, got {self.draft_ngram_tokens}")
        if self.draft_max_batch is not None and self.draft_max_batch < 1:
            raise ValueError(f"draft_max_batch must be >= 1 or None, got {self.draft_max_batch}")

    @property
    def draft_width(self) -> int:
        """Most drafts a request verifies in one step: k, or draft_ngram_tokens if longer (with
        draft_ngram). The scheduler keeps that many KV slots ahead of each request."""
        if self.draft_ngram:
            return max(self.num_speculative_tokens, self.draft_ngram_tokens)
        return self.num_speculative_tokens


@lru_cache(maxsize=256)  # rows share a job's pattern: read it once
def _pattern(regex: str | None, schema: str | None) -> str | None:
    pattern = schema_regex(schema) if schema is not None else regex
    if pattern is not None:
        parse(pattern)
    return pattern


def guided_pattern(params: SamplingParams) -> str | None:
    """The pattern a guided_regex or guided_json request's completion must match (read and
    checked: a ValueError says where it cannot be), or None."""
    return _pattern(params.guided_regex, params.guided_json)
