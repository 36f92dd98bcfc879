"""The engine a job runs on, built from its options (an engine that cannot be built is a user
error naming the option), and the context its shards run in, with the notes a user should read
about the model before the job starts."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from pipeline.config import JobConfig, JobError, job_default, one_line
from pipeline.shard import ShardContext
from pipeline.stages.generate import EngineLike
from pipeline.stages.tokenize import TokenizeOptions
from runtime.config import EngineConfig, PlacementError
from runtime.kv.groups import KVCacheBudgetError

_Engine = TypeVar("_Engine", bound=EngineLike)


def build_engine(factory: Callable[[EngineConfig], _Engine], config: EngineConfig) -> _Engine:
    """factory(config); a model or drafter that cannot load (OSError, ValueError) becomes a
    user error naming them."""
    try:
        return factory(config)
    except PlacementError as exc:
        raise JobError(str(exc)) from None
    except KVCacheBudgetError as exc:
        given = "(default)" if config.kv_cache_memory is None else config.kv_cache_memory
        raise JobError(f"--kv-cache-memory {given}: {one_line(exc)}") from None
    except (OSError, ValueError) as exc:
        what = f"--model {config.model}"
        if config.drafter:
            what += f" / --drafter {config.drafter}"
        raise JobError(f"cannot load {what}: {one_line(exc)}") from None


def shard_context(config: JobConfig, has_id_column: bool, engine: EngineLike) -> ShardContext:
    for option, listed in (("--stop-token-ids", config.stop_token_ids),
                           ("--allowed-token-ids", config.allowed_token_ids),
                           ("--logit-bias", [t for t, _ in config.logit_bias])):
        if outside := [t for t in listed if t >= engine.vocab_size]:
            raise JobError(f"{option}: {outside[0]} is outside the vocabulary of "
                           f"{engine.model_name} (ids 0 to {engine.vocab_size - 1})")
    if (params := config.sampling_params()).guided and (why := engine.guided_problem(params)):
        option = ("--guided-choice" if params.guided_choice else "--guided-regex"
                  if params.guided_regex is not None else "--guided-json")
        raise JobError(f"{option}: {why}")
    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    special = set(getattr(engine.tokenizer, "all_special_tokens", ()))
    if unseen := [s for s in config.stop if s in special]:
        ids = ",".join(str(engine.tokenizer.convert_tokens_to_ids(s)) for s in unseen)
        print(f"note: --stop {unseen[0]!r} is the text of a special token, which completions "
              f"leave out, so it never matches; to stop at it, use --stop-token-ids {ids}",
              file=sys.stderr)
    if config.messages_column is not None and not has_template:
        raise JobError(f"--messages-column {config.messages_column}: the tokenizer of "
                       f"{engine.model_name} has no chat template to render messages with")
    if config.messages_column is None and config.chat_template and not has_template:
        print(f"note: the tokenizer of {engine.model_name} has no chat template: prompts are "
              "tokenized as raw text, as with --no-chat-template", file=sys.stderr)
    if engine.max_model_len > engine.model_context:
        print(f"note: --max-model-len {engine.max_model_len} is past the context of "
              f"{engine.model_name} ({engine.model_context} tokens): positions beyond it are "
              "ones the model was not trained on", file=sys.stderr)
    if unapplied := _unapplied_generation_config(engine.unapplied_generation_config, config):
        names = [f.split(" ", 1)[0] for f in unapplied]
        apply_with = [option for name, (option, _) in _APPLIED_BY.items() if name in names]
        hint = f" ({' / '.join(apply_with)} can apply it)" if apply_with else ""
        print(f"note: the generation_config.json of {engine.model_name} sets "
              f"{', '.join(unapplied)}, which transformers' generate applies and eaglebatch does "
              f"not{hint}", file=sys.stderr)
    options = TokenizeOptions(config.prompt_column, config.messages_column,
                              config.chat_template and has_template, engine.max_model_len,
                              config.sampling_params())
    return ShardContext(engine, options, config.n, config.id_column, has_id_column,
                        config.output_dir, config.output_prefix, config.optional_columns(),
                        config.include_stop_str_in_output)


# generation_config.json fields that an option of the job applies: (the option, its JobConfig field)
_APPLIED_BY = {"repetition_penalty": ("--repetition-penalty", "repetition_penalty"),
               "min_new_tokens": ("--min-tokens", "min_tokens")}


def _unapplied_generation_config(fields: list[str], config: JobConfig) -> list[str]:
    """generation_config.json's fields ('name value') that the job does not apply: all of them
    but those whose option the job sets (its own value, which it applies)."""
    set_by_job = {name for name, (_, attr) in _APPLIED_BY.items()
                  if getattr(config, attr) != job_default(attr)}
    return [f for f in fields if f.split(" ", 1)[0] not in set_by_job]
