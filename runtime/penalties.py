"""Repetition, frequency and presence penalties on a step's logits, as vLLM defines them, and
min_tokens, which holds EOS back.

A request's logits at a verified position are penalized with the tokens that precede that
position: its prompt and outputs, then the drafts before it. So the logits that verify draft j
are those that plain decoding would have penalized after accepting drafts 0 .. j-1, and a
penalized request still samples exactly the same tokens with or without a drafter.

- repetition_penalty r: every token of the prompt or the outputs so far has its logit divided
  by r where it is positive, multiplied by r otherwise (transformers' RepetitionPenalty and
  vLLM's repetition_penalty; r > 1 discourages repeats);
- frequency_penalty f: each token's logit minus f times its count among the outputs;
- presence_penalty p: each token's logit minus p once it occurs among the outputs.

In that order, on the raw logits, before temperature, top-k and top-p. min_tokens n: the EOS
ids' logits are -inf at a position with fewer than n outputs before it (transformers'
min_new_tokens; vLLM's min_tokens, which holds its stop strings back too). Only the logits of the
tokens a row has seen change, so only those are gathered, penalized and written back, not
whole vocabularies.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from runtime.sequence import Sequence


def penalize(logits: Tensor, seqs: Seq[Sequence], drafts: Seq[Seq[int]]) -> Tensor:
    """Penalize `logits` ([rows, vocab] float32) in place and return them. Request b owns
    len(drafts[b]) + 1 consecutive rows, after those of the requests before it: one per draft
    it verifies in this step (drafts[b]), then the one after its last draft."""
    seen = _Entries()  # repetition: the prompt's and the outputs' tokens
    counted = _Entries()  # frequency and presence: the outputs' tokens, with their counts
    for seq, draft, row in _first_rows(seqs, drafts):
        params = seq.params
        if not params.penalized:
            continue
        outputs = Counter(seq.output_token_ids)
        prompt, prompt_tokens = _prompt_tokens(seq) if params.repetition_penalty != 1.0 else (
            frozenset(), None)
        for j in range(len(draft) + 1):
            if j:  # the draft before this row: one more output
                outputs[draft[j - 1]] += 1
            if prompt_tokens is not None:
                seen.add(row + j, params.repetition_penalty,
                         [t for t in outputs if t not in prompt], prompt_tokens)
            if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
                counted.add(row + j, (params.frequency_penalty, params.presence_penalty),
                            list(outputs), counts=list(outputs.values()))
    if seen.rows:
        index, r, _ = seen.tensors(logits.device)
        values = logits[index]
        logits[index] = torch.where(values > 0, values / r[:, 0], values * r[:, 0])
    if counted.rows:
        index, fp, count = counted.tensors(logits.device)
        values = logits[index] - fp[:, 0] * count
        logits[index] = values - fp[:, 1] * (count > 0)
    return logits


def _first_rows(seqs: Seq[Sequence], drafts: Seq[Seq[int]]
                ) -> Iterator[tuple[Sequence, Seq[int], int]]:
    """Each request with its drafts and its first row: request b owns len(drafts[b]) + 1
    consecutive rows, after those of the requests before it."""
    row = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        yield seq, draft, row
        row += len(draft) + 1


def _prompt_tokens(seq: Sequence) -> tuple[frozenset[int], array[int]]:
    """The prompt's distinct tokens, as a set and as an array; made once per request (kept on
    it: a long prompt's tokens were most of a step's penalty work)."""
    if seq.prompt_tokens_seen is None:
        distinct = frozenset(seq.token_ids[:seq.num_prompt_tokens])
        seq.prompt_tokens_seen = (distinct, array("q", sorted(distinct)))
    return seq.prompt_tokens_seen


class _Entries:
    """(row, token) pairs to penalize, with each row's penalties and each pair's count, gathered
    as Python lists and arrays and turned into tensors at once."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # one per penalized row
        self.sizes: list[int] = []  # its number of pairs
        self.penalties: list[tuple[float, ...]] = []  # its penalties
        self.tokens: list[int] = []  # per pair, a token
        self.counts: list[int] = []  # and its count (counted entries only)
        # a row's tokens added as one array: (where its own tokens end in `tokens`, the array)
        self.shared: list[tuple[int, array[int]]] = []

    def add(self, row: int, penalties: float | tuple[float, ...], tokens: list[int],
            shared: array[int] | None = None, counts: list[int] | None = None) -> None:
        self.rows.append(row)
        self.sizes.append(len(tokens) + (len(shared) if shared is not None else 0))
        self.penalties.append(penalties if isinstance(penalties, tuple) else (penalties,))
        self.tokens += tokens
        if counts is not None:
            self.counts += counts
        if shared is not None:
            self.shared.append((len(self.tokens), shared))

    def tensors(self, device: torch.device) -> tuple[tuple[Tensor, Tensor], Tensor, Tensor]:
        """((row, token) index, per-pair penalties [pairs, n], per-pair counts [pairs])."""
        own = torch.frombuffer(array("q", self.tokens), dtype=torch.int64) if self.tokens \
            else torch.empty(0, dtype=torch.int64)  # (an array converts ~10x faster)
        # each row's pairs: its own tokens, then its shared array (in the order they were added)
        pieces, at = [], 0
        for end, shared in self.shared:
            pieces += [own[at:end], torch.frombuffer(shared, dtype=torch.int64)]
            at = end
        tokens = torch.cat([*pieces, own[at:]]) if pieces else own
        sizes = torch.tensor(self.sizes)
        rows = torch.tensor(self.rows).repeat_interleave(sizes)
        penalties = torch.tensor(self.penalties, dtype=torch.float32).repeat_interleave(sizes,
                                                                                        dim=0)
        counts = (torch.frombuffer(array("q", self.counts), dtype=torch.int64).float()
                  if self.counts else torch.zeros(len(tokens)))
        return ((rows.to(device), tokens.to(device)), penalties.to(device), counts.to(device))


def hold_eos(logits: Tensor, seqs: Seq[Sequence], drafts: Seq[Seq[int]],
             eos_token_ids: frozenset[int]) -> Tensor:
    """-inf in place for the logits of the EOS ids and the request's stop_token_ids at every
    row with fewer than its request's min_tokens outputs (and drafts) before it; rows laid out
    as for penalize."""
    rows: list[int] = []
    ids: list[int] = []
    for seq, draft, row in _first_rows(seqs, drafts):
        short = seq.params.min_tokens - seq.num_output_tokens  # rows j < short are held
        if short <= 0:
            continue
        stops = sorted(eos_token_ids.union(seq.params.stop_token_ids))
        for held in range(row, row + min(short, len(draft) + 1)):
            rows += [held] * len(stops)
            ids += stops
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = float("-inf")
    return logits
