"""When does a request stop: EOS, max_tokens, the context limit, or a stop string."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from runtime.sequence import Sequence

# Extra tokens decoded around a stop string, so one split across tokens is still seen.
_STOP_WINDOW_SLACK = 4


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """Called after each appended token. Mutates seq.stop_string when a stop string hits."""
        params = seq.params
        if not params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return "stop"
        if params.stop and self._stop_string(seq) is not None:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> str | None:
        longest = max(len(s) for s in seq.params.stop)
        window = seq.output_token_ids[-(longest + _STOP_WINDOW_SLACK):]
        text = self.tokenizer.decode(window, skip_special_tokens=True)
        for stop in seq.params.stop:
            if stop in text:
                seq.stop_string = stop
                return stop
        return None
