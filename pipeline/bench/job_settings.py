"""The lines of a job's report that say how it was set up: its sampling, the columns it read
and wrote, its drafter (from manifest.json's config)."""

from __future__ import annotations

import os
from typing import Any

from pipeline.config import job_default
from runtime.loader import default_drafter

# sampling options shown only where not at the job's default (as `eaglebatch generate` spells
# them)
_SHOWN_WHEN_SET = ("min_tokens", "top_p", "top_k", "min_p", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "seed", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "allowed_token_ids")


def sampling_line(sampling: Any) -> str:
    """max_tokens and temperature, then every other sampling option the job set."""
    if not isinstance(sampling, dict):
        return "sampling not recorded"
    parts = [f"max_tokens {sampling.get('max_tokens')}",
             f"temperature {sampling.get('temperature')}"]
    parts += [f"{name} {sampling[name]}" for name in _SHOWN_WHEN_SET
              if sampling.get(name, job_default(name)) != job_default(name)]
    if bias := sampling.get("logit_bias"):  # [[id, bias], ...] as --logit-bias spells them
        try:
            parts.append("logit_bias " + ",".join(f"{t}:{b:g}" for t, b in bias))
        except (TypeError, ValueError):  # not as a job writes it
            parts.append(f"logit_bias {bias}")
    if sampling.get("guided_json") is not None:
        parts.append(f"guided_json {sampling['guided_json']}")
    if sampling.get("guided_regex") is not None:
        parts.append(f"guided_regex {sampling['guided_regex']!r}")
    if choices := sampling.get("guided_choice"):
        parts.append("guided_choice " + ", ".join(repr(c) for c in choices))
    if sampling.get("stop"):
        parts.append("stop " + ", ".join(repr(s) for s in sampling["stop"]))
    return ", ".join(parts)


def columns_line(config: dict[str, Any]) -> str:
    """The columns the job (its manifest's config) read and the prefix of those it wrote
    (--output-prefix), and the optional ones it wrote (--logprobs, --top-logprobs,
    --prompt-logprobs)."""
    columns = config.get("columns")
    if not isinstance(columns, dict):
        return "- columns: not recorded"
    read = (f"messages from `{columns['messages']}`" if columns.get("messages")
            else f"prompts from `{columns.get('prompt')}`")
    prefix = columns.get("output_prefix")
    wrote = f"`{prefix}completion`, ... (`--output-prefix {prefix}`)" if prefix else \
        "`completion`, ..."
    top = config.get("top_logprobs")
    optional = [f"`{prefix or ''}{name}` (`{option}`)" for key, name, option in (
        ("logprobs", "completion_logprobs", "--logprobs"),
        ("top_logprobs", "completion_top_logprobs", f"--top-logprobs {top}"),
        ("prompt_logprobs", "prompt_logprobs", "--prompt-logprobs")) if config.get(key)]
    if optional:
        wrote += " with " + (optional[0] if len(optional) == 1
                             else ", ".join(optional[:-1]) + " and " + optional[-1])
    return f"- {read}, ids from `{columns.get('id')}`; the job's columns {wrote}"


def drafter_label(config: dict[str, Any]) -> str:
    """The job's drafter: 'shipped (name)' for the one shipped with the model, else its path."""
    drafter = config.get("drafter")
    if not drafter:
        return "none"
    shipped = default_drafter(str(config.get("model")))
    if shipped is not None and os.path.abspath(drafter) == str(shipped):
        return f"shipped ({shipped.name})"
    return f"`{drafter}`"
