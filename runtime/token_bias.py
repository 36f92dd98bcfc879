"""allowed_token_ids and logit_bias on a step's logits, as vLLM applies them.

- allowed_token_ids: every other token's logit is -inf (vLLM's allowed_token_ids: a
  classification job's labels, say);
- logit_bias: each listed token's logit plus its bias (OpenAI's and vLLM's logit_bias, in
  [-100, 100]: -100 bans a token in practice, +100 all but forces it).

Both apply to the raw logits, before min_tokens' EOS hold and the penalties, as vLLM's sampler
orders them. Neither depends on the tokens so far, so every row a request verifies gets the
same change, and the tokens it emits are those of plain decoding with or without drafts (the
drafter proposes from its own distribution; verification decides).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import lru_cache

import torch
from torch import Tensor

from runtime.sequence import Sequence


def apply_token_bias(logits: Tensor, seqs: Seq[Sequence], rows_per_seq: Seq[int]) -> Tensor:
    """Applies each request's allowed_token_ids and logit_bias to its rows of `logits`
    ([rows, vocab] float32, in place) and returns them; request b owns rows_per_seq[b]
    consecutive rows, after those of the requests before it."""
    row = 0
    for seq, count in zip(seqs, rows_per_seq, strict=True):
        params = seq.params
        if params.allowed_token_ids:
            allowed = _index(params.allowed_token_ids, logits.device)
            kept = logits[row:row + count].index_select(1, allowed)
            logits[row:row + count] = float("-inf")
            logits[row:row + count, allowed] = kept
        if params.logit_bias:
            ids, bias = _bias(params.logit_bias, logits.device)
            logits[row:row + count, ids] += bias
        row += count
    return logits


@lru_cache(maxsize=64)  # a job's rows share a few settings; each step reads them again
def _index(ids: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


@lru_cache(maxsize=64)
def _bias(pairs: tuple[tuple[int, float], ...], device: torch.device) -> tuple[Tensor, Tensor]:
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device)
    return ids, torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
