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
    # min_tokens held the stop back from the text of the first tokens (stop_held_tokens)
    held_chars = [0] * len(completions)
    held = [i for i, c in enumerate(completions) if c.stop_string and c.stop_held_tokens]
    if held:
        prefixes = tokenizer.batch_decode(
            [list(completions[i].token_ids[:completions[i].stop_held_tokens]) for i in held],
            skip_special_tokens=True)
        for i, prefix in zip(held, prefixes, strict=True):
            held_chars[i] = len(str(prefix).rstrip(PARTIAL))
    return [cut_at_stop(str(text).rstrip(PARTIAL), c.stop_string, include_stop, chars)
            for text, c, chars in zip(texts, completions, held_chars, strict=True)]


def cut_at_stop(text: str, stop_string: str | None, include_stop: bool = False,
                held_chars: int = 0) -> str:
    """The text before the stop string's first occurrence that ends after its first held_chars
    characters (through it, with include_stop)."""
    if not stop_string:
        return text
    at = text.find(stop_string, max(0, held_chars - len(stop_string) + 1))
    return text if at < 0 else text[:at + (len(stop_string) if include_stop else 0)]
