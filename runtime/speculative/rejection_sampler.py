"""Verification of draft tokens against the target model: the one place tokens are sampled.

Pure tensor functions: no engine state, no host sync. Plain decoding calls them with k = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

PLACEHOLDER_TOKEN_ID = -1  # marks output positions after the last emitted token


def sample_and_verify(
    draft_token_ids: Tensor,  # [batch, k] int64; entries at j >= num_draft_tokens[b] are ignored
    num_draft_tokens: Tensor,  # [batch] int64, 0..k
    target_probs: Tensor,  # [batch, k + 1, vocab] float32, from runtime.sampler.target_probs
    greedy: Tensor,  # [batch] bool
    uniforms: Tensor,  # [batch, k + 1] float64 in [0, 1): runtime.sampler.position_uniforms
) -> Tensor:  # [batch, k + 1] int64
    """Verify each request's draft tokens and emit 1 .. num_draft_tokens[b] + 1 tokens.

    Every emitted token is the target's own draw at its position: for greedy rows the argmax of
    target_probs[b, j], for random rows the token where the target's cumulative distribution
    (in vocabulary order) first exceeds uniforms[b, j]. A draft is accepted while it equals that
    draw; at the first draft that differs, and after the last one, the draw itself is emitted.

    So for a random row a draft x is accepted with probability p_t(x), which is what rejection
    sampling's min(1, p_t(x) / p_d(x)) gives a drafter that proposes one token (p_d one-hot:
    the engine's drafters), and every emitted token is exactly p_t-distributed, the draws of
    different positions being independent. Unlike rejection sampling with its own random
    numbers, the emitted tokens do not depend on the drafts at all: with a position's uniform
    fixed by the request's seed and the token's index (position_uniforms), a seeded request
    samples the same tokens with or without a drafter, whatever its batch, token budget or
    preemptions, wherever the target's probabilities are the same bits (float32 on the CPU).

    Returns [batch, k + 1]: accepted tokens, then the draw at the stop position, then
    PLACEHOLDER_TOKEN_ID. Example, k = 3, drafts [7, 8, 9], draws [7, 5, 9, 2]: [7, 5, -1, -1].
    """
    batch, k = draft_token_ids.shape
    if uniforms.shape != (batch, k + 1):
        raise ValueError(f"got uniforms of shape {tuple(uniforms.shape)} for a batch of {batch} "
                         f"with {k} draft positions; need [{batch}, {k + 1}]")
    # positions past a row's drafts are never emitted: no draw there
    needed = torch.arange(k + 1, device=draft_token_ids.device) <= num_draft_tokens.unsqueeze(-1)
    return greedy_verify(draft_token_ids, num_draft_tokens,
                         draw_tokens(target_probs, greedy, uniforms, needed))


def draw_tokens(
    target_probs: Tensor,  # [batch, positions, vocab] float32, rows summing to 1 (or any mass)
    greedy: Tensor,  # [batch] bool
    uniforms: Tensor,  # [batch, positions] float64 in [0, 1)
    needed: Tensor | None = None,  # [batch, positions] bool: where to draw (None: everywhere)
) -> Tensor:  # [batch, positions] int64; the argmax where not needed
    """The argmax for greedy rows; for the others the inverse of the distribution function at
    the uniform, summed in float64 (a float32 sum over a large vocabulary drifts by more than
    the smallest probabilities). A token of probability 0 is never drawn."""
    batch, positions, vocab = target_probs.shape
    drawn = target_probs.argmax(-1)
    wanted = (~greedy).unsqueeze(-1).expand(batch, positions)
    if needed is not None:
        wanted = wanted & needed
    at = wanted.flatten().nonzero().squeeze(-1)  # (row, position) pairs, flattened
    if at.numel() == 0:
        return drawn
    probs = target_probs.reshape(batch * positions, vocab).index_select(0, at)
    cdf = probs.double().cumsum(-1)
    u = uniforms.reshape(-1).to(cdf.device, torch.float64).index_select(0, at).unsqueeze(-1)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # first cdf > u*mass
    # u * mass may round up to the whole mass: take the last token that has any
    last = vocab - 1 - (probs.flip(-1) > 0).long().argmax(-1)
    drawn.view(-1)[at] = torch.minimum(index, last)
    return drawn


def num_accepted(
    output_token_ids: Tensor,  # [batch, k + 1] int64, from sample_and_verify
    num_draft_tokens: Tensor,  # [batch] int64
) -> Tensor:  # [batch] int64
    """Accepted draft tokens per request: emitted tokens - 1 (never more than num_draft_tokens)."""
    if output_token_ids.shape[0] != num_draft_tokens.shape[0]:
        raise ValueError(f"{output_token_ids.shape[0]} output rows for "
                         f"{num_draft_tokens.shape[0]} requests")
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=-1) - 1


def greedy_verify(
    draft_token_ids: Tensor,  # [batch, k] int64; entries at j >= num_draft_tokens[b] are ignored
    num_draft_tokens: Tensor,  # [batch] int64, 0..k
    target_argmax: Tensor,  # [batch, k + 1] int64, argmax of the target's logits per position
) -> Tensor:  # [batch, k + 1] int64, same layout as sample_and_verify's output
    """sample_and_verify for a batch whose rows are all greedy, without building distributions
    or drawing noise: accept while draft == argmax, then emit the argmax at the stop position
    (the recovered token on a mismatch, the bonus token when all drafts agree)."""
    batch, k = draft_token_ids.shape
    device = target_argmax.device
    valid = torch.arange(k, device=device) < num_draft_tokens.unsqueeze(-1)  # [batch, k]
    accepted = (draft_token_ids == target_argmax[:, :k]) & valid
    num_acc = accepted.long().cumprod(dim=-1).sum(dim=-1, keepdim=True)  # [batch, 1]
    position = torch.arange(k + 1, device=device)  # [k + 1]
    # accepted drafts equal the argmax at their positions, so the argmax row up to and including
    # the stop position is exactly the emitted sequence
    return torch.where(position <= num_acc, target_argmax, PLACEHOLDER_TOKEN_ID)
