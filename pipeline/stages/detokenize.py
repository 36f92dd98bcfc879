"""Detokenize stage: completion token ids -> text (special tokens skipped, cut at the stop)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.request import Completion
from runtime.stop import PARTIAL


def detokenize(completions: Sequence[Completion], tokenizer: Any,
               include_stop: bool = False) -> list[str]:
    """One string per completion, decoded in one batched call.

    The engine keeps the tokens that produced a stop string in token_ids; the text is cut at the
    stop string's first occurrence (the stop string itself is not part of the completion, unless
    include_stop: --include-stop-str-in-output). A
    completion that ends inside a character (cut by max_tokens between the bytes of one UTF-8
    sequence) loses the replacement characters that the partial bytes decode to; its
    completion_token_ids keep every token.
    """
    if not completions:
        return []
    texts = tokenizer.batch_decode([list(c.token_ids) for c in completions],
                                   skip_special_tokens=True)
    return [cut_at_stop(str(text).rstrip(PARTIAL), c.stop_string, include_stop)
            for text, c in zip(texts, completions, strict=True)]


def cut_at_stop(text: str, stop_string: str | None, include_stop: bool = False) -> str:
    """The text before the stop string's first occurrence (through it, with include_stop)."""
    if not stop_string:
        return text
    at = text.find(stop_string)
    return text if at < 0 else text[:at + (len(stop_string) if include_stop else 0)]
