"""Tokenize stage: input rows -> prompt token ids and per-row sampling parameters.

A row that cannot be generated (null or empty prompt, malformed messages, a prompt that leaves no
room in the model's context, a bad per-row override) becomes a PreparedRow with `error` set; the job
writes it with finish_reason "error" and goes on. max_tokens is lowered to fit the context
(prompt + completion <= max_model_len), and `max_tokens_clamped` records that it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import pyarrow as pa

from pipeline.config import one_line
from pipeline.schema import OVERRIDE_COLUMNS, python_values
from runtime.config import SamplingParams


class PreparedRow(NamedTuple):
    prompt_token_ids: tuple[int, ...] | None  # None when the row could not be tokenized
    params: SamplingParams | None  # None on error
    max_tokens_clamped: bool
    error: str | None
    row_seed: bool = False  # params.seed is the row's own (its seed column), not the job's


class TokenizeOptions(NamedTuple):
    prompt_column: str
    messages_column: str | None
    use_chat_template: bool  # the job asks for it AND the tokenizer has one
    max_model_len: int
    defaults: SamplingParams


def tokenize_rows(rows: pa.Table | pa.RecordBatch, tokenizer: Any,
                  options: TokenizeOptions) -> list[PreparedRow]:
    """One PreparedRow per input row, in order. Never raises for a bad row."""
    if options.messages_column is not None:
        texts = [_render_messages(m, tokenizer)
                 for m in _values(rows, options.messages_column)]
    else:
        prompts = _values(rows, options.prompt_column)
        texts = [_render_prompt(p, tokenizer, options.use_chat_template) for p in prompts]
    token_ids = _tokenize(texts, tokenizer, add_special_tokens=not options.use_chat_template)
    overrides = {name: _values(rows, name)
                 for name in OVERRIDE_COLUMNS if name in rows.schema.names}
    prepared = []
    for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
        row_overrides = {name: values[i] for name, values in overrides.items()}
        bad = [v for v in row_overrides.values() if isinstance(v, _RowError)]
        if isinstance(text, _RowError) or bad:
            error = text if isinstance(text, _RowError) else bad[0]
            prepared.append(PreparedRow(None, None, False, error.message))
        else:
            assert ids is not None
            prepared.append(_prepare(tuple(ids), row_overrides, options))
    return prepared


class _RowError(NamedTuple):
    message: str


def _values(rows: pa.Table | pa.RecordBatch, name: str) -> list[Any]:
    """The column's values as Python objects; one that is not valid UTF-8 becomes a _RowError
    naming the column, and only its row fails."""
    return [_RowError(f"{name} is not valid UTF-8 ({v.reason} at byte {v.start}: "
                      f"{v.object[v.start:v.start + 4]!r})")
            if isinstance(v, UnicodeDecodeError) else v
            for v in python_values(rows.column(name))]


def _render_prompt(prompt: str | None | _RowError, tokenizer: Any,
                   use_chat_template: bool) -> str | _RowError:
    if isinstance(prompt, _RowError):
        return prompt
    if prompt is None:
        return _RowError("prompt is null")
    if not prompt:  # whitespace is text: "\n" is a prompt a raw completion may continue
        return _RowError("prompt is empty")
    if not use_chat_template:
        return prompt
    return _apply_template([{"role": "user", "content": prompt}], tokenizer)


def _render_messages(messages: list[dict[str, Any]] | None | _RowError,
                     tokenizer: Any) -> str | _RowError:
    if isinstance(messages, _RowError):
        return messages
    problem = messages_problem(messages)
    if problem is not None:
        return _RowError(problem)
    assert messages is not None
    return _apply_template(clean_messages(messages), tokenizer)


def messages_problem(messages: list[dict[str, Any]] | None) -> str | None:
    """Why a row's chat cannot be rendered (null, empty, a message without role or content), or
    None when it can."""
    if messages is None:
        return "messages is null"
    if not messages:
        return "messages is empty"
    for i, message in enumerate(messages):
        if message is None:
            return f"messages[{i}] is null"
        if not message.get("role"):
            return f"messages[{i}] has no role"
        if message.get("content") is None:
            return f"messages[{i}] ({message['role']}) has null content"
    return None


def clean_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without the struct fields that are null in them (a chat template tests
    `'name' in message`, not whether it is None)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _apply_template(messages: list[dict[str, Any]], tokenizer: Any) -> str | _RowError:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template is the model's code: any failure is a row error
        return _RowError(f"chat template failed: {one_line(exc)}")
    return str(text)


def _tokenize(texts: Sequence[str | _RowError], tokenizer: Any,
              add_special_tokens: bool) -> list[list[int] | None]:
    """Tokenize the good texts in one batched call; None where the text is an error."""
    good = [t for t in texts if isinstance(t, str)]
    encoded = iter(tokenizer(good, add_special_tokens=add_special_tokens)["input_ids"]
                   if good else [])
    return [next(encoded) if isinstance(t, str) else None for t in texts]


# the guided decoding options, and each one's "none"
_GUIDED: dict[str, Any] = {"guided_choice": (), "guided_regex": None, "guided_json": None}


def _prepare(ids: tuple[int, ...], overrides: dict[str, Any],
             options: TokenizeOptions) -> PreparedRow:
    limit = options.max_model_len
    if not ids:
        return PreparedRow(ids, None, False, "prompt has no tokens")
    if len(ids) > limit - 1:
        return PreparedRow(ids, None, False,
                           f"prompt has {len(ids)} tokens; the model's context is {limit} tokens, "
                           f"so a prompt may have at most {limit - 1}")
    changes = {name: value for name, value in overrides.items() if value is not None}
    if "stop" in changes:
        changes["stop"] = tuple(s for s in changes["stop"] if s)
    for name in ("stop_token_ids", "allowed_token_ids"):  # sorted, once each, as the options
        if name in changes:
            changes[name] = tuple(sorted({t for t in changes[name] if t is not None}))
    if "guided_choice" in changes:  # sorted, once each, as the option; null entries are none
        changes["guided_choice"] = tuple(sorted({c for c in changes["guided_choice"]
                                                 if c is not None}))
    given = [name for name in _GUIDED if name in changes]
    for name in ("guided_regex", "guided_json"):
        if name in changes and not changes[name]:  # "": none for this row
            changes[name] = None
    if given:  # a row's guidance replaces the job's, of any kind
        changes = {**{name: _GUIDED[name] for name in _GUIDED}, **changes}
    if "logit_bias" in changes:  # a map's (id, bias) pairs; a null bias is none
        changes["logit_bias"] = tuple(sorted((t, float(b)) for t, b in changes["logit_bias"]
                                             if b is not None))
    try:
        params = replace(options.defaults, **changes)
    except ValueError as exc:
        return PreparedRow(ids, None, False, f"bad per-row sampling option: {exc}")
    room = limit - len(ids)
    row_seed = "seed" in changes
    if params.max_tokens > room:
        return PreparedRow(ids, replace(params, max_tokens=room), True, None, row_seed)
    return PreparedRow(ids, params, False, None, row_seed)
