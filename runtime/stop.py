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
        if params.stop and self._stop_string(seq) is not None:
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
        end in the last token, the one that begins first is the one the text is cut at."""
        longest = max(len(s.encode("utf-8", "surrogatepass")) for s in seq.params.stop)
        window = seq.output_token_ids[-(longest + _STOP_WINDOW_SLACK):]
        text = str(self.tokenizer.decode(window, skip_special_tokens=True))
        if len(window) < seq.num_output_tokens:  # begins inside the output, maybe mid-character
            text = text.lstrip(PARTIAL)
        text = text.rstrip(PARTIAL)
        found = [(text.find(stop), i) for i, stop in enumerate(seq.params.stop) if stop in text]
        if not found:
            return None
        seq.stop_string = seq.params.stop[min(found)[1]]
        return seq.stop_string
