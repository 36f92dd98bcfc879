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
                   "frequency_penalty", "presence_penalty", "seed")


def sampling_line(sampling: Any) -> str:
    """max_tokens and temperature, then every other sampling option the job set."""
    if not isinstance(sampling, dict):
        return "sampling not recorded"
    parts = [f"max_tokens {sampling.get('max_tokens')}",
             f"temperature {sampling.get('temperature')}"]
    parts += [f"{name} {sampling[name]}" for name in _SHOWN_WHEN_SET
              if sampling.get(name, job_default(name)) != job_default(name)]
    if sampling.get("stop"):
        parts.append("stop " + ", ".join(repr(s) for s in sampling["stop"]))
    return ", ".join(parts)


def columns_line(columns: Any, logprobs: bool = False, top_logprobs: int = 0) -> str:
    """The columns the job read and the prefix of those it wrote (--output-prefix), and
    completion_logprobs / completion_top_logprobs where it wrote them (--logprobs,
    --top-logprobs)."""
    if not isinstance(columns, dict):
        return "- columns: not recorded"
    read = (f"messages from `{columns['messages']}`" if columns.get("messages")
            else f"prompts from `{columns.get('prompt')}`")
    prefix = columns.get("output_prefix")
    wrote = f"`{prefix}completion`, ... (`--output-prefix {prefix}`)" if prefix else \
        "`completion`, ..."
    optional = ([f"`{prefix or ''}completion_logprobs` (`--logprobs`)"] if logprobs else []) + (
        [f"`{prefix or ''}completion_top_logprobs` (`--top-logprobs {top_logprobs}`)"]
        if top_logprobs else [])
    if optional:
        wrote += " with " + " and ".join(optional)
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
