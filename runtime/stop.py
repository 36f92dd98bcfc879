"""When does a request stop: EOS, max_tokens, the context limit, or a stop string."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from runtime.sequence import Sequence

# Extra tokens decoded around a stop string, so one split across tokens is still seen.
_STOP_WINDOW_SLACK = 4
PARTIAL = "\ufffd"  # what a decoder gives for bytes that do not complete a character


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """Called after each appended token. Mutates seq.stop_string when a stop string hits."""
        params = seq.params
        last = seq.token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return "stop"
        # min_tokens holds stop strings back too, as vLLM's does: only one that ends after the
        # text of the first min_tokens tokens counts
        if (params.stop and seq.num_output_tokens > params.min_tokens
                and self._stop_string(seq) is not None):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> str | None:
        """The stop string that the last token completed, if any. Every token holds at least
        one byte of text, so the last (UTF-8 bytes of the longest stop + slack) tokens hold any
        stop that ends in the last one; a CJK character or an emoji may take 2-4 tokens, so
        counting characters fell short. The window may begin and end inside a character: the
        replacement characters those partial bytes decode to are not text. Where several stops
        end in the last token, the one that begins first is the one the text is cut at. Where
        the window holds some of the first min_tokens tokens, a stop must end after their text."""
        longest = max(len(s.encode("utf-8", "surrogatepass")) for s in seq.params.stop)
        window = seq.output_token_ids[-(longest + _STOP_WINDOW_SLACK):]
        inside = len(window) < seq.num_output_tokens  # begins inside the output
        text = self._text(window, inside)
        held = seq.params.min_tokens - (seq.num_output_tokens - len(window))
        held_chars = len(self._text(window[:held], inside)) if held > 0 else 0
        found = [(at, i) for i, stop in enumerate(seq.params.stop)
                 if (at := text.find(stop, max(0, held_chars - len(stop) + 1))) >= 0]
        if not found:
            return None
        seq.stop_string = seq.params.stop[min(found)[1]]
        return seq.stop_string

    def _text(self, tokens: list[int], inside: bool) -> str:
        """The tokens' text without the partial characters at its edges (at its start only
        where it begins inside the output, maybe mid-character)."""
        text = str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return (text.lstrip(PARTIAL) if inside else text).rstrip(PARTIAL)
