"""runtime.token_bytes: each token's bytes are what the tokenizer decodes, for byte-level BPE
(the tiny tokenizer, SmolLM2's) and SentencePiece-style vocabularies."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from runtime.token_bytes import TokenBytes


def _decodes_alike(tokenizer: PreTrainedTokenizerFast, spelled: TokenBytes,
                   groups: list[list[int]] | None = None, strip_one_space: bool = False,
                   only_in_groups: range = range(0)) -> None:
    """Random token sequences (with `groups` of tokens mixed in whole, and the tokens of
    `only_in_groups` only so): their bytes, as UTF-8, are the tokenizer's decoded text."""
    rng = random.Random(0)
    ordinary = [[t] for t, b in enumerate(spelled.by_id) if t not in only_in_groups]
    for _ in range(300):
        ids = [t for g in rng.choices(ordinary + (groups or []) * 20, k=rng.randint(1, 12))
               for t in g]
        text = b"".join(spelled.by_id[t] or b"" for t in ids).decode("utf-8", "replace")
        if strip_one_space and text.startswith(" "):  # SentencePiece's decoder drops it
            text = text[1:]
        assert text == tokenizer.decode(ids, skip_special_tokens=True), ids  # as completions
    for special in tokenizer.all_special_ids:
        assert spelled.by_id[special] is None
    for i, added in tokenizer.added_tokens_decoder.items():  # <repo_name> and such in SmolLM2
        assert spelled.by_id[i] == (None if added.special else added.content.encode())


def test_byte_level_tokens_spell_what_the_tokenizer_decodes(
        tiny_tokenizer: PreTrainedTokenizerFast, smollm2_dir: Path) -> None:
    _decodes_alike(tiny_tokenizer, TokenBytes(tiny_tokenizer, len(tiny_tokenizer)))
    real = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    spelled = TokenBytes(real, len(real))
    _decodes_alike(real, spelled)
    assert spelled.spells("Zürich \u2603".encode())


def test_sentencepiece_tokens_spell_what_the_tokenizer_decodes() -> None:
    """A Llama-2-style vocabulary: U+2581 for spaces, <0xNN> byte tokens for the rest."""
    pieces = sorted(set("\u2581the capital of France is Paris".replace(" ", "\u2581")))
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("a", "r"), ("i", "s")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in pieces + ["".join(m) for m in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    spelled = TokenBytes(fast, len(fast))
    assert spelled.by_id[vocab["<0xC3>"]] == b"\xc3"
    assert spelled.by_id[vocab["\u2581the"]] == b" the"
    assert spelled.spells("Zürich is \u2603".encode())  # letters it lacks, from bytes
    utf8 = [[vocab[f"<0x{b:02X}>"] for b in c.encode()] for c in "ü\u2603é"]
    # alone, most bytes are not UTF-8: mixed in only as whole characters
    _decodes_alike(fast, spelled, utf8, strip_one_space=True, only_in_groups=range(3, 259))
