"""Guided choice: a request's completion is one of a few given strings (vLLM's guided_choice,
structured outputs' `choice`: labels for a classification job, yes / no, ...).

The text generated so far, as bytes, is the state. A token may come next when the state plus
the token's bytes is still the start of some choice; the EOS ids only once the state is a
whole choice (and then nothing else, unless a longer choice goes on from it). So any way the
tokenizer can spell a choice is open to the model, and a completion that ends at EOS is
exactly one of the choices. Every row a request verifies gets the mask of the state after the
drafts before it, so a drafter changes no token (a draft the mask forbids is rejected there).

Tokens' bytes come from the tokenizer's vocabulary: byte-level BPE (GPT-2, Llama 3, Qwen,
SmolLM) maps each byte to one character; SentencePiece vocabularies (Llama 2, Mistral) write
a space as U+2581 and other bytes as <0xNN>. Special tokens spell nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from runtime.sequence import Sequence as Seq

_SENTENCEPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token id's bytes (None for a special token, or one that spells nothing), and the
    ids of each byte string."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.by_id: list[bytes | None] = _token_bytes(tokenizer, vocab_size)
        ids: dict[bytes, list[int]] = {}
        for token, spelled in enumerate(self.by_id):
            if spelled:
                ids.setdefault(spelled, []).append(token)
        self.ids = ids
        self.longest = max(map(len, ids), default=0)

    def spells(self, text: bytes) -> bool:
        """Whether some sequence of tokens spells exactly `text`."""
        reachable = [True] + [False] * len(text)
        for start in range(len(text)):
            if reachable[start]:
                for end in range(start + 1, min(len(text), start + self.longest) + 1):
                    if text[start:end] in self.ids:
                        reachable[end] = True
        return reachable[-1]


class ChoiceGuide:
    """The allowed next tokens of one request's choices, by state (cached)."""

    def __init__(self, choices: Sequence[str], tokens: TokenBytes,
                 eos_token_ids: frozenset[int]) -> None:
        self.choices = sorted({c.encode("utf-8", "surrogatepass") for c in choices})
        self.tokens = tokens
        self.eos = sorted(eos_token_ids)
        self._allowed: dict[bytes, list[int]] = {}

    def state(self, token_ids: Sequence[int]) -> bytes | None:
        """The bytes of these tokens, or None where they leave every choice (or spell
        nothing)."""
        spelled = [self.tokens.by_id[t] if 0 <= t < len(self.tokens.by_id) else None
                   for t in token_ids]
        if any(s is None for s in spelled):
            return None
        text = b"".join(s for s in spelled if s is not None)
        return text if any(c.startswith(text) for c in self.choices) else None

    def allowed(self, state: bytes) -> list[int]:
        """The ids that may follow `state`: those whose bytes go on along some choice, and
        the EOS ids where `state` is a whole choice."""
        found = self._allowed.get(state)
        if found is None:
            ids: set[int] = set()
            for choice in self.choices:
                if choice.startswith(state):
                    rest = choice[len(state):]
                    for end in range(1, min(len(rest), self.tokens.longest) + 1):
                        ids.update(self.tokens.ids.get(rest[:end], ()))
            found = sorted(ids) + (self.eos if state in self.choices else [])
            self._allowed[state] = found
        return found

    @cached_property
    def unspellable(self) -> str | None:
        """A choice this vocabulary cannot spell, if any."""
        return next((c.decode("utf-8", "replace") for c in self.choices
                     if not self.tokens.spells(c)), None)


def _token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("guided choice needs a fast (tokenizers) tokenizer")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if "ByteLevel" in kinds:
        byte_of = {c: b for b, c in _byte_level_chars().items()}

        def spell(piece: str) -> bytes | None:
            if any(c not in byte_of for c in piece):
                return None
            return bytes(byte_of[c] for c in piece)
    elif "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        def spell(piece: str) -> bytes | None:
            if (byte := _BYTE_TOKEN.fullmatch(piece)) is not None:
                return bytes([int(byte.group(1), 16)])
            return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")
    else:
        raise ValueError(f"guided choice cannot read this tokenizer's tokens as bytes (its "
                         f"decoder is {sorted(k for k in kinds if k)})")
    out: list[bytes | None] = [None if i in special or p is None else spell(p)
                               for i, p in enumerate(pieces)]
    return out + [None] * (vocab_size - len(out))


def _byte_level_chars() -> dict[int, str]:
    """Byte-level BPE's alphabet: each byte as one printable character. Bytes that print as
    themselves keep their character; the others take the characters from U+0100 on, in
    byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return chars


class Guides:
    """One engine's ChoiceGuides, by choices, over its tokenizer's bytes (read on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._tokens: TokenBytes | None = None
        self._guides: dict[tuple[str, ...], ChoiceGuide] = {}

    def for_choices(self, choices: tuple[str, ...]) -> ChoiceGuide:
        guide = self._guides.get(choices)
        if guide is None:
            if self._tokens is None:
                self._tokens = TokenBytes(self._tokenizer, self._vocab_size)
            guide = self._guides[choices] = ChoiceGuide(choices, self._tokens, self._eos)
        return guide

    def problem(self, choices: tuple[str, ...]) -> str | None:
        """Why a request with these choices cannot run here, or None."""
        if not self._eos:
            return "guided choice ends a completion at EOS, and this model has no EOS id"
        try:
            unspellable = self.for_choices(choices).unspellable
        except ValueError as exc:
            return str(exc)
        if unspellable is not None:
            return f"guided choice {unspellable!r}: no tokens of this vocabulary spell it"
        return None


def apply_guides(logits: Tensor, seqs: Sequence[Seq], drafts: Sequence[Sequence[int]],
                 guide_for: Callable[[tuple[str, ...]], ChoiceGuide]) -> Tensor:
    """-inf in place for every token a guided request may not take next, at each of its rows:
    row j after its outputs and drafts 0 .. j-1 (rows laid out as runtime.penalties.penalize
    has them). Past a draft that leaves every choice, rows are left as they are: verification
    rejects that draft, and those rows' tokens are thrown away."""
    row = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        choices = seq.params.guided_choice
        if choices:
            guide = guide_for(choices)
            state = guide.state(seq.output_token_ids)
            for j in range(len(draft) + 1):
                if state is None:
                    break
                allowed = torch.tensor(guide.allowed(state), dtype=torch.int64,
                                       device=logits.device)
                kept = logits[row + j].index_select(0, allowed)
                logits[row + j] = float("-inf")
                logits[row + j, allowed] = kept
                if j < len(draft):
                    state = guide.state([*seq.output_token_ids, *draft[:j + 1]])
        row += len(draft) + 1
    return logits
