"""The frozen configuration of one job, and the fingerprint that decides whether a rerun may resume.

Every `eaglebatch generate` option lands in exactly one field here (engine options in `engine`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.config import EngineConfig, SamplingParams


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type's name where it has none), without control
    characters (a library's message may quote the raw bytes it choked on)."""
    text = "".join(c if c.isprintable() else " " for c in str(exc))
    return " ".join(text.split()) or type(exc).__name__


class JobError(Exception):
    """A problem of the user's making (bad input, bad option, refused resume).

    The message is one line that names the file, column or option; the CLI prints it and exits 2.
    """


@dataclass(frozen=True)
class RayConfig:
    """`--runner ray`: where the shards run. Left out of the fingerprint, like every runner option:
    a job started on one runner may be finished on another."""

    address: str | None = None  # None: start a local Ray instance; "auto" or HOST:PORT: join one
    num_workers: int | None = None  # None: one per GPU for GPU workers, else 1
    gpus_per_worker: float | None = None  # None: 1 if the cluster has GPUs and device != cpu

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 1:
            raise JobError(f"--num-workers must be >= 1, got {self.num_workers}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise JobError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")


def check_messages_template(messages_column: str | None, chat_template: bool) -> None:
    """A messages column is rendered with the chat template (generate's and bench's options)."""
    if messages_column is not None and not chat_template:
        raise JobError("--messages-column needs the chat template; drop --no-chat-template")


# sampling options a job's fingerprint records only where they differ from JobConfig's default
OPTIONAL_SAMPLING = ("min_tokens", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "stop_token_ids", "ignore_eos",
                     "include_stop_str_in_output", "allowed_token_ids", "logit_bias",
                     "guided_choice", "guided_regex", "guided_json")


def job_default(name: str) -> Any:
    """JobConfig's default for the field `name` (the value at which an option is off)."""
    return next(f.default for f in fields(JobConfig) if f.name == name)


@dataclass(frozen=True)
class JobConfig:
    """One `eaglebatch generate` job. The sampling fields are the defaults for every row; optional
    input columns (pipeline.schema.OVERRIDE_COLUMNS) override them row by row."""

    input: str
    output_dir: str
    prompt_column: str = "prompt"
    id_column: str = "id"
    messages_column: str | None = None
    # put before the names of the columns the job adds (judge_ -> judge_completion, ...)
    output_prefix: str = ""
    chat_template: bool = True
    shard_rows: int = 10_000
    n: int = 1
    overwrite: bool = False
    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS does not end a row (stop strings and stop_token_ids do)
    include_stop_str_in_output: bool = False  # the completion keeps the stop string
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated (() = all)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    guided_choice: tuple[str, ...] = ()  # the completion is one of these (then EOS)
    guided_regex: str | None = None  # the completion matches this whole (then EOS)
    guided_json: str | None = None  # the completion is JSON this schema allows (then EOS)
    logprobs: bool = False  # a completion_logprobs column
    top_logprobs: int = 0  # a completion_top_logprobs column of this many tokens (0 = none)
    prompt_logprobs: bool = False  # a prompt_logprobs column
    engine: EngineConfig = field(default_factory=EngineConfig)
    ray: RayConfig | None = None  # None: the local runner (one engine in this process)

    def __post_init__(self) -> None:
        if self.shard_rows < 1:
            raise JobError(f"--shard-rows must be >= 1, got {self.shard_rows}")
        if self.n < 1:
            raise JobError(f"--n must be >= 1, got {self.n}")
        check_messages_template(self.messages_column, self.chat_template)
        if any(c.isspace() or not c.isprintable() or "\ud800" <= c <= "\udfff"
               for c in self.output_prefix):
            raise JobError(f"--output-prefix {self.output_prefix!r}: column names made with it "
                           "would hold spaces, control characters or bytes that are not UTF-8; "
                           "choose letters, digits and signs such as _")
        try:
            self.sampling_params()
        except ValueError as exc:
            raise JobError(f"bad sampling option: {exc}") from None

    def sampling_params(self) -> SamplingParams:
        """The job-wide defaults as engine SamplingParams (rows may override fields)."""
        return SamplingParams(max_tokens=self.max_tokens, min_tokens=self.min_tokens,
                              temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty,
                              allowed_token_ids=self.allowed_token_ids,
                              logit_bias=self.logit_bias, guided_choice=self.guided_choice,
                              guided_regex=self.guided_regex, guided_json=self.guided_json,
                              logprobs=self.logprobs,
                              top_logprobs=self.top_logprobs,
                              prompt_logprobs=self.prompt_logprobs)

    def optional_columns(self) -> tuple[str, ...]:
        """The output columns of pipeline.schema.OPTIONAL_FIELDS the job writes."""
        return ((("completion_logprobs",) if self.logprobs else ())
                + (("completion_top_logprobs",) if self.top_logprobs else ())
                + (("prompt_logprobs",) if self.prompt_logprobs else ()))

    def _optional_sampling(self) -> dict[str, Any]:
        """min_tokens, min_p, the penalties, ... where they are on (manifests of jobs without
        them stay resumable); tuples as the lists JSON reads back (logit_bias's pairs too)."""
        return {name: [list(v) if isinstance(v, tuple) else v for v in value]
                if isinstance(value, tuple) else value
                for name in OPTIONAL_SAMPLING
                if (value := getattr(self, name)) != job_default(name)}

    def placement_options(self) -> dict[str, str]:
        """Where the engine runs, as given: the attention backends sum in other orders and a GPU
        runs bfloat16, so greedy tokens may differ (pipeline.manifest.check_placement)."""
        return {"dtype": self.engine.dtype, "device": self.engine.device,
                "attention_backend": self.engine.attention_backend}

    def fingerprint(self) -> dict[str, Any]:
        """Everything that changes the outputs. A rerun whose fingerprint differs from the one in
        manifest.json is refused (unless --overwrite). Batch sizes and cache memory are left out:
        they change speed, not outputs (each request samples with its own seed)."""
        return {
            "model": _as_path_if_exists(self.engine.model),
            # a checkpoint directory or .gguf file may be rewritten between runs (see
            # manifest.check_resumable for manifests written before this was recorded)
            **_model_digest(self.engine.model),
            "drafter": (None if self.engine.drafter is None
                        else _as_path_if_exists(self.engine.drafter)),
            # drafting leaves greedy and seeded outputs as they are, but not the rows' drafted
            # and accepted counts: a job's parts come from one drafting setup
            "num_speculative_tokens": self.engine.num_speculative_tokens,
            "draft_confidence": self.engine.draft_confidence,
            "draft_int8": self.engine.draft_int8,
            "draft_ngram": self.engine.draft_ngram,
            **self.placement_options(),
            "max_model_len": self.engine.max_model_len,
            "sampling": {"max_tokens": self.max_tokens, "temperature": self.temperature,
                         "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                         "stop": list(self.stop), **self._optional_sampling()},
            "columns": {"prompt": self.prompt_column, "id": self.id_column,
                        "messages": self.messages_column,
                        # only where given: the manifests of jobs without it stay resumable
                        **({"output_prefix": self.output_prefix} if self.output_prefix else {})},
            # only where given, as output_prefix: it adds a column
            **({"logprobs": True} if self.logprobs else {}),
            **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {}),
            **({"prompt_logprobs": True} if self.prompt_logprobs else {}),
            "chat_template": self.chat_template,
            "n": self.n,
            "shard_rows": self.shard_rows,
        }


def _model_digest(name: str) -> dict[str, str]:
    """{"model_digest": ...} for a model given as a checkpoint directory or a .gguf file (its
    config and weights: runtime.loader.checkpoint_digest); {} for the built-in name, and for a
    path that is not a readable checkpoint (building the engine then says what is wrong)."""
    if not os.path.exists(name):
        return {}
    from runtime.loader import checkpoint_digest  # noqa: PLC0415 (torch and transformers)

    try:
        return {"model_digest": checkpoint_digest(Path(name))}
    except OSError:
        return {}


def _as_path_if_exists(name: str) -> str:
    """A model given as a path is recorded absolute, so a rerun from another directory matches."""
    return os.path.abspath(name) if os.path.exists(name) else name
