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
tokens a row has seen change, so they are gathered, penalized and written back: a batch of 64
rows reads a few thousand logits, not 64 whole vocabularies.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence as Seq
from itertools import repeat

import torch
from torch import Tensor

from runtime.sequence import Sequence


def penalize(logits: Tensor, seqs: Seq[Sequence], drafts: Seq[Seq[int]]) -> Tensor:
    """Penalize `logits` ([rows, vocab] float32) in place and return them. Request b owns
    len(drafts[b]) + 1 consecutive rows, after those of the requests before it: one per draft
    it verifies in this step (drafts[b]), then the one after its last draft."""
    rows: list[int] = []  # the penalized rows
    entries: list[int] = []  # per penalized row, how many of its tokens are penalized
    tokens: list[int] = []  # per entry: a token the row has seen
    counts: list[int] = []  # and its count among the outputs (and drafts) before the row
    penalties: list[tuple[float, float, float]] = []
    row = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        params = seq.params
        if not params.penalized:
            row += len(draft) + 1
            continue
        outputs = Counter(seq.output_token_ids)
        seen = list(outputs.keys() | (set(seq.token_ids[:seq.num_prompt_tokens])
                                      if params.repetition_penalty != 1.0 else set()))
        seen_counts = list(map(outputs.get, seen, repeat(0)))
        for j in range(len(draft) + 1):
            if j:  # the draft before this row: one more output
                token = draft[j - 1]
                if outputs[token] == 0 and token not in seen:
                    seen.append(token)
                    seen_counts.append(0)
                outputs[token] += 1
                seen_counts[seen.index(token)] += 1
            rows.append(row)
            entries.append(len(seen))
            tokens += seen
            counts += seen_counts
            penalties.append((params.repetition_penalty, params.frequency_penalty,
                              params.presence_penalty))
            row += 1
    if not tokens:  # (no outputs yet, and no repetition penalty)
        return logits
    device = logits.device
    per_row = torch.tensor(entries, device=device)
    index = (torch.tensor(rows, device=device).repeat_interleave(per_row),
             torch.frombuffer(array("q", tokens), dtype=torch.int64).to(device))
    # (an array converts a list of ints ~10x faster than torch.tensor)
    count = torch.frombuffer(array("q", counts), dtype=torch.int64).to(device, torch.float32)
    r, f, p = torch.tensor(penalties, dtype=torch.float32, device=device).repeat_interleave(
        per_row, dim=0).unbind(-1)
    values = logits[index]
    values = torch.where(values > 0, values / r, values * r)
    values = values - f * count
    values = values - p * (count > 0)
    logits[index] = values
    return logits


def hold_eos(logits: Tensor, seqs: Seq[Sequence], drafts: Seq[Seq[int]],
             eos_token_ids: frozenset[int]) -> Tensor:
    """-inf in place for the EOS ids' logits at every row with fewer than its request's
    min_tokens outputs (and drafts) before it; rows laid out as for penalize."""
    held: list[int] = []
    row = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        positions = len(draft) + 1
        short = seq.params.min_tokens - seq.num_output_tokens  # rows j < short are held
        held += range(row, row + min(max(short, 0), positions))
        row += positions
    if held and eos_token_ids:
        device = logits.device
        logits[torch.tensor(held, device=device).unsqueeze(1),
               torch.tensor(sorted(eos_token_ids), device=device)] = float("-inf")
    return logits
