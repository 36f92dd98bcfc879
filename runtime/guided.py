"""Guided decoding: a request's completion is one of a few strings (guided_choice) or matches a
regular expression (guided_regex), then EOS, as vLLM's guided_choice and guided_regex.

A guide has a start state and moves along one token at a time (None once the text leaves every
completion it allows; a request keeps its state after its outputs, Sequence.guide_state), and
gives for a state the mask of the tokens that may come next: those whose bytes
(runtime.token_bytes) keep the text on a way to a whole completion, and the EOS ids where the
text is one. So any spelling the tokenizer has is open to the model, and a completion that
ends at EOS is exactly an allowed one. Each row a request verifies gets the mask of the state
after the drafts before it, so a drafter changes no token (a draft the mask forbids is
rejected there).

- ChoiceGuide: the state is the text's bytes; the next tokens are looked up by the bytes
  each choice has left (no walk over the vocabulary).
- RegexGuide: the state is a state of the pattern's DFA (runtime.regex_dfa); a state's mask
  walks all the vocabulary's byte strings at once, a byte position at a time, through the
  DFA's transition array (RegexDFA.walk_many). Masks are cached by state (a pattern's
  completions pass through the same states; a count such as [^"]{0,300} has one per count).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from functools import cached_property
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from runtime.config import SamplingParams, guided_pattern
from runtime.cpu_kernels import argmax_rows
from runtime.regex_dfa import DEAD, RegexDFA
from runtime.sequence import Sequence as Seq
from runtime.token_bytes import TokenBytes

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
MAX_MASKS = 512  # a guide's masks kept (25 MB for the default model's vocabulary)
MAX_GUIDES = 64  # guides kept, with their masks and automata


def _recent(cache: OrderedDict[K, V], key: K, make: Callable[[K], V], limit: int) -> V:
    """cache[key], made by make(key) where missing; the `limit` most recently used are kept."""
    found = cache.get(key)
    if found is None:
        found = cache[key] = make(key)
        if len(cache) > limit:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


class Guide(Protocol):
    @property
    def start(self) -> Hashable: ...  # the state before any token

    def advance(self, state: Hashable, token: int) -> Hashable | None: ...

    def allows(self, state: Hashable, token: int) -> bool: ...  # may come next

    def mask(self, state: Hashable) -> Tensor: ...  # [vocab] bool: may come next


class _Masks:
    """A guide's masks by state, from its `allowed` ids."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self.eos_set = eos_token_ids
        # a vocabulary's worth of bools each (49 KB for the default model): the most recent
        self._masks: OrderedDict[Hashable, Tensor] = OrderedDict()

    def mask(self, state: Hashable) -> Tensor:
        return _recent(self._masks, state, self._build_mask, MAX_MASKS)

    def _build_mask(self, state: Hashable) -> Tensor:
        found = torch.zeros(self.vocab_size, dtype=torch.bool)
        found[self.allowed(state)] = True
        return found

    def allowed(self, state: Hashable) -> list[int]:
        raise NotImplementedError

    def advance(self, state: Hashable, token: int) -> Hashable | None:
        raise NotImplementedError

    def complete(self, state: Hashable) -> bool:
        """The text is a whole completion: EOS may come."""
        raise NotImplementedError

    def allows(self, state: Hashable, token: int) -> bool:
        """`token` may come after `state` (its mask's entry, without building the mask)."""
        if token in self.eos_set:
            return self.complete(state)
        return self.advance(state, token) is not None


class ChoiceGuide(_Masks):
    """The completion is one of `choices`."""

    def __init__(self, choices: Sequence[str], tokens: TokenBytes,
                 eos_token_ids: frozenset[int]) -> None:
        super().__init__(tokens.vocab_size, eos_token_ids)
        self.choices = sorted({c.encode("utf-8", "surrogatepass") for c in choices})
        self.tokens = tokens
        self.start = b""

    def advance(self, state: Hashable, token: int) -> bytes | None:
        """The text's bytes with the token's, or None where they leave every choice."""
        assert isinstance(state, bytes)
        spelled = self.tokens.by_id[token] if 0 <= token < self.vocab_size else None
        if spelled is None:
            return None
        text = state + spelled
        return text if any(c.startswith(text) for c in self.choices) else None

    def complete(self, state: Hashable) -> bool:
        return state in self.choices

    def allowed(self, state: Hashable) -> list[int]:
        assert isinstance(state, bytes)
        ids: set[int] = set()
        for choice in self.choices:
            if choice.startswith(state):
                rest = choice[len(state):]
                for end in range(1, min(len(rest), self.tokens.longest) + 1):
                    ids.update(self.tokens.ids.get(rest[:end], ()))
        return sorted(ids) + (self.eos if state in self.choices else [])

    @cached_property
    def problem(self) -> str | None:
        bad = next((c for c in self.choices if not self.tokens.spells(c)), None)
        if bad is None:
            return None
        return f"guided choice {bad.decode('utf-8', 'replace')!r}: no tokens of this " \
               "vocabulary spell it"


class RegexGuide(_Masks):
    """The completion matches `pattern` (as re.fullmatch, runtime.regex_dfa's syntax)."""

    def __init__(self, pattern: str, tokens: TokenBytes, eos_token_ids: frozenset[int]) -> None:
        super().__init__(tokens.vocab_size, eos_token_ids)
        self.dfa = RegexDFA(pattern)
        self.tokens = tokens
        self.start = self.dfa.start

    def _build_mask(self, state: Hashable) -> Tensor:
        """The tokens whose bytes keep the DFA alive from `state` (all byte strings walked at
        once, RegexDFA.walk_many), and EOS where `state` is a whole match."""
        assert isinstance(state, int)
        tokens = self.tokens
        alive = self.dfa.walk_many(state, tokens.matrix, tokens.lengths)
        spelled = tokens.row_of >= 0
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[spelled] = alive[tokens.row_of[spelled]]
        if self.dfa.accepting(state):
            allowed[self.eos] = True
        return torch.from_numpy(allowed)

    def advance(self, state: Hashable, token: int) -> int | None:
        """The DFA's state after the token's bytes, or None once they leave the pattern."""
        assert isinstance(state, int)
        spelled = self.tokens.by_id[token] if 0 <= token < self.vocab_size else None
        found = DEAD if spelled is None else self.dfa.walk(state, spelled)
        return None if found == DEAD else found

    def complete(self, state: Hashable) -> bool:
        assert isinstance(state, int)
        return self.dfa.accepting(state)

    def allowed(self, state: Hashable) -> list[int]:
        return torch.nonzero(self.mask(state)).flatten().tolist()

    @cached_property
    def problem(self) -> str | None:
        if not self.allowed(self.dfa.start):
            return f"guided regex {self.dfa.pattern!r}: no token of this vocabulary starts it"
        return None


class Guides:
    """One engine's guides, by request settings, over its tokenizer's bytes (read on first
    use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._tokens: TokenBytes | None = None
        # the most recently used (per-row patterns may each be another)
        self._guides: OrderedDict[tuple[str, ...] | str, ChoiceGuide | RegexGuide] = \
            OrderedDict()

    def for_params(self, params: SamplingParams) -> ChoiceGuide | RegexGuide:
        pattern = guided_pattern(params)
        key = params.guided_choice or pattern
        assert key, "not a guided request"

        def build(_: tuple[str, ...] | str) -> ChoiceGuide | RegexGuide:
            if self._tokens is None:
                self._tokens = TokenBytes(self._tokenizer, self._vocab_size)
            if params.guided_choice:
                return ChoiceGuide(params.guided_choice, self._tokens, self._eos)
            return RegexGuide(pattern or "", self._tokens, self._eos)

        return _recent(self._guides, key, build, MAX_GUIDES)

    def problem(self, params: SamplingParams) -> str | None:
        """Why a request guided so cannot run here, or None."""
        if not self._eos:
            return "guided decoding ends a completion at EOS, and this model has no EOS id"
        try:
            return self.for_params(params).problem
        except ValueError as exc:  # the tokenizer's bytes, or the pattern
            return str(exc)


def _guided_rows(seqs: Sequence[Seq], drafts: Sequence[Sequence[int]],
                 guide_for: Callable[[SamplingParams], Guide]
                 ) -> Iterator[tuple[int, Guide, Hashable]]:
    """(row, guide, state) for each row of a guided request: row j after its outputs and drafts
    0 .. j-1 (rows laid out as runtime.penalties.penalize has them). Rows past a draft that
    leaves the guide are not given: verification rejects that draft, and their tokens are
    thrown away."""
    row = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        if seq.params.guided:
            guide, state = _guide_and_state(seq, guide_for)
            for j in range(len(draft) + 1):
                if state is None:
                    break
                yield row + j, guide, state
                if j < len(draft):
                    state = guide.advance(state, draft[j])
        row += len(draft) + 1


def guides_allow(best: list[int], seqs: Sequence[Seq], drafts: Sequence[Sequence[int]],
                 guide_for: Callable[[SamplingParams], Guide]) -> bool:
    """Whether every guided row's argmax (best, by row) is a token its guide allows there: then
    masking would leave the argmax as it is, and greedy decoding needs no mask."""
    return all(guide.allows(state, best[row])
               for row, guide, state in _guided_rows(seqs, drafts, guide_for))


def apply_guides(logits: Tensor, seqs: Sequence[Seq], drafts: Sequence[Sequence[int]],
                 guide_for: Callable[[SamplingParams], Guide], greedy: bool = False) -> Tensor:
    """-inf in place for every token a guided request may not take next, at each of its rows.
    greedy (every row takes its argmax): a row whose argmax its guide allows is left as it is,
    as masking would not change its argmax (ties included: argmax takes the first)."""
    rows = list(_guided_rows(seqs, drafts, guide_for))
    best = argmax_rows(logits).tolist() if greedy and rows else None
    for row, guide, state in rows:
        if best is not None and guide.allows(state, best[row]):
            continue
        mask = guide.mask(state).to(logits.device)
        logits[row].masked_fill_(~mask[:logits.shape[1]], float("-inf"))
    return logits


def _guide_and_state(seq: Seq, guide_for: Callable[[SamplingParams], Guide]
                     ) -> tuple[Guide, Hashable | None]:
    """The request's guide and its state after the request's outputs, moved on from the ones
    kept on it (a request keeps its guide: a state means something to its own guide only,
    and Guides may have let go of it and built another)."""
    guide, done, state = seq.guide_state or (guide_for(seq.params), 0, None)
    outputs = seq.output_token_ids
    if done == 0 or done > len(outputs):  # (outputs only grow; were they cut, read them again)
        done, state = 0, guide.start
    for token in outputs[done:]:
        if state is None:
            break
        state = guide.advance(state, token)
    seq.guide_state = (guide, len(outputs), state)
    return guide, state
