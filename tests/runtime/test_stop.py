"""StopChecker on the default model's byte-level tokenizer, where a CJK character or an emoji
may take several tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from runtime.config import SamplingParams
from runtime.sequence import Sequence
from runtime.stop import StopChecker


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _feed(tokenizer: PreTrainedTokenizerFast, text: str, stop: tuple[str, ...],
          min_tokens: int = 0) -> tuple[int | None, str | None]:
    """Appends text's tokens one by one; (how many were appended when a stop string hit, which
    one), or (None, None)."""
    checker = StopChecker(tokenizer, frozenset())
    seq = Sequence("r", [1], SamplingParams(max_tokens=10_000, stop=stop, min_tokens=min_tokens),
                   0, 0)
    for token in tokenizer.encode(text, add_special_tokens=False):
        seq.token_ids.append(token)
        if checker.check(seq, 100_000) == "stop":
            return seq.num_output_tokens, seq.stop_string
    return None, None


def test_a_stop_of_characters_of_several_tokens_each_is_seen(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """The window was the stop's length in characters + 4 tokens: 8 tokens for 【答案】 (12 bytes),
    which never held it whole."""
    for stop in ("【答案】", "😀😀😀"):
        before = f"{stop[:2]}A\n" * 3
        tokens = len(tokenizer.encode(before + stop, add_special_tokens=False))
        assert len(tokenizer.encode(stop, add_special_tokens=False)) == 9  # > 4 + 4 or 3 + 4
        assert _feed(tokenizer, before + stop + "B", (stop,)) == (tokens, stop)


def test_of_stops_ending_in_the_same_token_the_one_that_begins_first_wins(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """The completion is cut before the stop string: with 'bc' chosen, 'xabc' was cut to 'xa',
    which still holds the other stop 'abc'."""
    assert [tokenizer.decode([t]) for t in tokenizer.encode("xabcd")] == ["x", "ab", "cd"]
    assert _feed(tokenizer, "xabcd", ("bc", "abc")) == (3, "abc")
    assert _feed(tokenizer, "xabcd", ("abc", "bc")) == (3, "abc")
    assert _feed(tokenizer, "xabcd", ("bc", "ab")) == (2, "ab")  # ends first


def test_the_partial_characters_at_the_windows_edges_are_not_text(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """A window that ends inside an emoji decodes its bytes so far to U+FFFD: a stop '\\ufffd'
    ended the row at the emoji's first token. A whole U+FFFD in the text still stops it, once a
    token follows it (until then it may be the start of a character)."""
    assert _feed(tokenizer, "a😀b😀c" * 3, ("\ufffd",)) == (None, None)
    text = "a😀b\ufffdc"
    assert len(tokenizer.encode(text[:4], add_special_tokens=False)) == 6
    assert _feed(tokenizer, text, ("\ufffd",)) == (7, "\ufffd")


@pytest.mark.slow
def test_drafts_accepted_after_the_stop_are_not_counted(smollm2_dir: Path) -> None:
    """A stop string inside a step's accepted drafts throws the tokens after it away: they were
    counted as accepted all the same (num_accepted 33 for 44 tokens here, in 14 draft steps)."""
    from runtime.config import EngineConfig  # noqa: PLC0415
    from runtime.engine import Engine  # noqa: PLC0415
    from runtime.loader import default_drafter  # noqa: PLC0415
    from runtime.request import GenerationRequest  # noqa: PLC0415

    engine = Engine(EngineConfig(kv_cache_memory=1 << 26, drafter=str(default_drafter(
        "smollm2-135m-instruct")), num_speculative_tokens=8, draft_ngram=True,
        draft_ngram_tokens=8, draft_confidence=0.0, draft_max_batch=None))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        add_generation_prompt=True, tokenize=True)
    prompt = tuple(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    stopped, whole = engine.generate([
        GenerationRequest("stopped", prompt, SamplingParams(max_tokens=60, stop=("9. 9",))),
        GenerationRequest("whole", prompt, SamplingParams(max_tokens=60))])
    text = engine.tokenizer.decode(list(stopped.token_ids))
    assert text == "".join(f"{i}. {i}\n" for i in range(1, 9)) + "9. 9"
    assert stopped.token_ids == whole.token_ids[:len(stopped.token_ids)]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 44
    # each draft step gives its accepted drafts and the target's token (the last one's may be
    # cut off by the stop); the prefill gives the first token
    assert stopped.num_accepted + stopped.num_draft_steps in (43, 44)
    assert whole.num_accepted > stopped.num_accepted


def _held_back(tokenizer: PreTrainedTokenizerFast, text: str, stop: tuple[str, ...],
               min_tokens: int) -> tuple[int | None, str | None]:
    """vLLM's min_tokens for stop strings, by hand: from the (min_tokens + 1)-th token on, the
    first prefix of the tokens whose text holds a stop that ends after the text of the first
    min_tokens tokens (the one that begins first)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    held = len(tokenizer.decode(tokens[:min_tokens]).rstrip("\ufffd"))
    for k in range(min_tokens + 1, len(tokens) + 1):
        decoded = tokenizer.decode(tokens[:k]).rstrip("\ufffd")
        hits = [(at, i) for i, s in enumerate(stop)
                if (at := decoded.find(s, max(0, held - len(s) + 1))) >= 0]
        if hits:
            return k, stop[min(hits)[1]]
    return None, None


@pytest.mark.parametrize(("text", "stop"), [
    ("a\nb\nc\nd\ne\nf", ("\n",)),
    ("前【答案】中【答案】后【答案】", ("【答案】",)),  # a stop of 9 tokens across the held edge
    ("xx abc yy bc abc zz", ("abc", "bc")),
])
def test_min_tokens_holds_stop_strings_back_as_vllm(tokenizer: PreTrainedTokenizerFast,
                                                    text: str, stop: tuple[str, ...]) -> None:
    """With min_tokens n a stop string counts only where it ends after the first n tokens'
    text, for every n along the text; without, the first one stops."""
    n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    results = [_feed(tokenizer, text, stop, n) for n in range(n_tokens + 1)]
    assert results == [_held_back(tokenizer, text, stop, n) for n in range(n_tokens + 1)]
    assert results[0] == _feed(tokenizer, text, stop)
    assert len({r for r in results if r[0] is not None}) >= 3  # the hold moved the stop
