"""Each token's bytes, as the tokenizer's decoder would write them, for guided decoding.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) maps each byte to one character of its
vocabulary; SentencePiece vocabularies (Llama 2, Mistral) write a space as U+2581 and other
bytes as <0xNN> tokens. Special tokens spell nothing (None): completions leave them out.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

_SENTENCEPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token id's bytes (None for a special token, or one that spells nothing), and the
    ids of each byte string."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.by_id: list[bytes | None] = _token_bytes(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        ids: dict[bytes, list[int]] = {}
        for token, spelled in enumerate(self.by_id):
            if spelled:
                ids.setdefault(spelled, []).append(token)
        self.ids = ids
        self.longest = max(map(len, ids), default=0)
        # the distinct byte strings as rows of a zero-padded array, and each token's row (-1:
        # none), for walks over the whole vocabulary at once (RegexDFA.walk_many)
        self.strings = list(ids)
        self.lengths = np.array([len(s) for s in self.strings], dtype=np.int64)
        self.matrix = np.zeros((len(self.strings), self.longest), dtype=np.uint8)
        for i, s in enumerate(self.strings):
            self.matrix[i, :len(s)] = np.frombuffer(s, dtype=np.uint8)
        self.row_of = np.full(vocab_size, -1, dtype=np.int64)
        for i, s in enumerate(self.strings):
            self.row_of[ids[s]] = i

    def spells(self, text: bytes) -> bool:
        """Whether some sequence of tokens spells exactly `text`."""
        reachable = [True] + [False] * len(text)
        for start in range(len(text)):
            if reachable[start]:
                for end in range(start + 1, min(len(text), start + self.longest) + 1):
                    if text[start:end] in self.ids:
                        reachable[end] = True
        return reachable[-1]


def _token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("guided decoding needs a fast (tokenizers) tokenizer")
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
        raise ValueError(f"guided decoding cannot read this tokenizer's tokens as bytes (its "
                         f"decoder is {sorted(k for k in kinds if k)})")
    out: list[bytes | None] = [None if i in special or p is None else spell(p)
                               for i, p in enumerate(pieces)]
    # added tokens: a special one is left out of decoded text (skip_special_tokens), as the
    # completions leave it; another is its content, as written
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if i < len(out):
            out[i] = None if added.special else added.content.encode("utf-8")
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
