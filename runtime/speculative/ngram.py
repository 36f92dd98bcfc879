"""N-gram lookup drafts: where the text so far repeats, propose what followed the last time.

Small models' answers repeat their prompt and themselves (code being fixed, list items of one
shape, names): when the last n tokens (n = 4, 3, then 2) occurred earlier in the request's prompt
or output, the tokens that followed that latest earlier occurrence are a cheap and often right
proposal. The EAGLE proposer offers them instead of the drafter's own drafts
(EngineConfig.draft_ngram); verification decides every emitted token, so outputs do not change.

Worked example, orders (3, 2), k = 2, tokens [5, 6, 7, 8, 5, 6]: the last 3 tokens [8, 5, 6] never
occurred before; the last 2, [5, 6], ended at index 2 the last time (tokens 5, 6 at 0..1), so the
proposal is the tokens from index 2 on: [7, 8].
"""

from __future__ import annotations

from collections.abc import Sequence

ORDERS = (4, 3, 2)  # suffix lengths tried, longest first


class NgramIndex:
    """For one request: for each order n, every n-gram of its tokens that has a token after it,
    mapped to the index of that token in its latest occurrence. Fed the growing token list
    (prompt, then verified outputs); each token is indexed once."""

    __slots__ = ("_ends", "_length")

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._length = 0  # tokens indexed so far

    def extend(self, tokens: Sequence[int]) -> None:
        """Indexes tokens[self._length:]; `tokens` must extend what was indexed before."""
        for end in range(max(self._length, 1), len(tokens)):
            for n in ORDERS:  # the n-gram ending right before token `end`; later ends overwrite
                if end >= n:
                    self._ends[tuple(tokens[end - n:end])] = end
        self._length = max(self._length, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (of length 4, 3 or 2) that occurred before; [] when none did. Call extend(tokens)
        first."""
        for n in ORDERS:
            if len(tokens) <= n:
                continue
            end = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:  # end <= len(tokens) - 1: the suffix itself is not indexed yet
                return list(tokens[end:min(end + k, len(tokens))])
        return []

    def propose_after(self, tokens: Sequence[int], drafts: Sequence[int], k: int) -> list[int]:
        """propose() for `tokens` followed by `drafts` not indexed (a proposal's continuation):
        the suffix may end in the drafts; its earlier occurrence is looked up in what is
        indexed, and what followed it is read from tokens + drafts. Call extend(tokens) first."""
        return self.propose([*tokens, *drafts], k)
