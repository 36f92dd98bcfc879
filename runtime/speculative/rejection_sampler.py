"""Verification of draft tokens against the target model: the one place tokens are sampled.

A pure tensor function: no engine state, no host sync. Plain decoding calls it with k = 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

PLACEHOLDER_TOKEN_ID = -1  # marks output positions after the last emitted token


class _Noise(NamedTuple):
    uniform: Tensor  # [batch, k] float32 in [0, 1), one per draft position
    exponential: Tensor  # [batch, vocab] float32, Exp(1): one categorical draw per request


def rejection_sample(
    draft_token_ids: Tensor,  # [batch, k] int64; entries at j >= num_draft_tokens[b] are ignored
    num_draft_tokens: Tensor,  # [batch] int64, 0..k
    draft_probs: Tensor | None,  # [batch, k, vocab] float32; None: greedy drafter (one-hot)
    target_probs: Tensor,  # [batch, k + 1, vocab] float32, from runtime.sampler.target_probs
    greedy: Tensor,  # [batch] bool
    generators: Sequence[torch.Generator | None],  # one per request; None -> global RNG
) -> Tensor:  # [batch, k + 1] int64
    """Verify each request's draft tokens and emit 1 .. num_draft_tokens[b] + 1 tokens.

    Let n = num_draft_tokens[b], x_j the draft token at position j, p_t = target_probs[b, j] and
    p_d = draft_probs[b, j] (a one-hot at x_j when draft_probs is None).

    - accepted tokens: the leading draft tokens that pass verification, emitted unchanged.
      Greedy rows accept x_j while x_j == argmax p_t. Random rows accept x_j with probability
      min(1, p_t(x_j) / p_d(x_j)).
    - recovered token: emitted at the first rejected position j, then the row stops. Greedy rows
      emit argmax p_t; random rows sample from normalise(max(0, p_t - p_d)) (p_t itself if that
      residual has no mass), which makes the emitted token exactly p_t-distributed.
    - bonus token: emitted at position n when all n drafts were accepted: argmax of
      target_probs[b, n] for greedy rows, a sample from it for random rows. With n = 0 this is
      plain sampling.

    Returns [batch, k + 1]: accepted tokens, then the recovered-or-bonus token, then
    PLACEHOLDER_TOKEN_ID. Example, k = 3, drafts [7, 8, 9], 8 rejected and 5 recovered:
    [7, 5, -1, -1].

    Randomness: every call draws, per request, k uniforms and then vocab Exp(1) variables from
    that request's generator, whatever happens to the row (greedy rows included), so a seeded
    request's tokens depend only on its seed, its inputs and k, never on the rest of the batch.
    The engine keeps k fixed (num_speculative_tokens) across steps.
    """
    batch, k = draft_token_ids.shape
    device = target_probs.device
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    noise = _draw_noise(generators, batch, k, target_probs.shape[-1], device)
    rows = torch.arange(batch, device=device)

    # Unused positions may hold PLACEHOLDER_TOKEN_ID; gather at 0 there, then mask out.
    valid = torch.arange(k, device=device) < num_draft_tokens.unsqueeze(-1)  # [batch, k]
    drafts = torch.where(valid, draft_token_ids, 0)  # [batch, k]
    p_t_draft = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    if draft_probs is None:
        p_d_draft = torch.ones_like(p_t_draft)
    else:
        p_d_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [batch, k]

    # Accept x with probability min(1, p_t(x) / p_d(x)): with u ~ U[0, 1), accept iff
    # u * p_d(x) < p_t(x). Strict, so a token the target gives probability 0 is never accepted.
    accept_random = noise.uniform * p_d_draft < p_t_draft
    accept_greedy = drafts == target_probs[:, :k].argmax(-1)
    accepted = torch.where(greedy.unsqueeze(-1), accept_greedy, accept_random) & valid
    # Length of the leading run of accepted positions: [1, 1, 0, 1] -> cumprod [1, 1, 0, 0] -> 2.
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    rejected = num_accepted < num_draft_tokens  # [batch]

    # The last emitted token comes from row s = num_accepted: the rejected position, or n.
    p_t_last = target_probs[rows, num_accepted]  # [batch, vocab]
    residual = _residual(p_t_last, draft_probs, drafts, num_accepted, rejected)  # [batch, vocab]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_t_last)
    last_dist = torch.where(rejected.unsqueeze(-1), residual, p_t_last)
    # Exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) samples i with probability
    # w_i / sum(w), so the residual needs no normalising.
    sampled = (last_dist / noise.exponential).argmax(-1)
    last_token = torch.where(greedy, p_t_last.argmax(-1), sampled)  # [batch]

    # Example, k = 3, drafts [7, 8, 9], num_accepted = 1, last_token = 5:
    # position [0, 1, 2, 3] < 1 -> [7, -1, -1, -1]; position == 1 -> [7, 5, -1, -1].
    position = torch.arange(k + 1, device=device)  # [k + 1]
    padded = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=-1)  # [batch, k + 1]
    out = torch.where(position < num_accepted.unsqueeze(-1), padded, PLACEHOLDER_TOKEN_ID)
    return torch.where(position == num_accepted.unsqueeze(-1), last_token.unsqueeze(-1), out)


def num_accepted(
    output_token_ids: Tensor,  # [batch, k + 1] int64, from rejection_sample
    num_draft_tokens: Tensor,  # [batch] int64
) -> Tensor:  # [batch] int64
    """Accepted draft tokens per request: emitted tokens - 1 (never more than num_draft_tokens)."""
    if output_token_ids.shape[0] != num_draft_tokens.shape[0]:
        raise ValueError(f"{output_token_ids.shape[0]} output rows for "
                         f"{num_draft_tokens.shape[0]} requests")
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=-1) - 1


def _residual(
    p_t_last: Tensor,  # [batch, vocab] target distribution at the stop position
    draft_probs: Tensor | None,  # [batch, k, vocab] or None (one-hot drafter)
    drafts: Tensor,  # [batch, k] int64, 0 at unused positions
    stop: Tensor,  # [batch] int64, the stop position (num_accepted)
    rejected: Tensor,  # [batch] bool; where False the result is not used
) -> Tensor:  # [batch, vocab] max(0, p_t - p_d), unnormalised
    batch, k = drafts.shape
    if k == 0:
        return p_t_last  # nothing can be rejected
    stop = stop.clamp(max=k - 1).unsqueeze(-1)  # [batch, 1]; clamped rows are not rejected
    if draft_probs is None:
        # One-hot p_d at the rejected draft: the residual is p_t without that token.
        rejected_draft = drafts.gather(-1, stop)  # [batch, 1]
        return p_t_last.scatter(-1, rejected_draft, 0.0)
    p_d_last = draft_probs[torch.arange(batch, device=drafts.device), stop.squeeze(-1)]
    return (p_t_last - p_d_last).clamp(min=0.0)


def _draw_noise(
    generators: Sequence[torch.Generator | None],
    batch: int,
    k: int,
    vocab: int,
    device: torch.device,
) -> _Noise:
    """Per request: k uniforms, then vocab exponentials, from its own generator. Requests
    without a generator share one batched draw from the global RNG."""
    uniform = torch.empty(batch, k, device=device)
    exponential = torch.empty(batch, vocab, device=device)
    shared = [b for b, g in enumerate(generators) if g is None]
    if len(shared) == batch:
        uniform.uniform_()
        exponential.exponential_()
    elif shared:
        index = torch.tensor(shared, device=device)
        uniform[index] = torch.rand(len(shared), k, device=device)
        exponential[index] = torch.empty(len(shared), vocab, device=device).exponential_()
    for b, generator in enumerate(generators):
        if generator is not None:
            uniform[b].uniform_(generator=generator)
            exponential[b].exponential_(generator=generator)
    # Exp(1) may round to 0 in float32; keep the race's division finite.
    exponential.clamp_(min=torch.finfo(exponential.dtype).tiny)
    return _Noise(uniform, exponential)


def greedy_verify(
    draft_token_ids: Tensor,  # [batch, k] int64; entries at j >= num_draft_tokens[b] are ignored
    num_draft_tokens: Tensor,  # [batch] int64, 0..k
    target_argmax: Tensor,  # [batch, k + 1] int64, argmax of the target's logits per position
) -> Tensor:  # [batch, k + 1] int64, same layout as rejection_sample's output
    """rejection_sample for a batch whose rows are all greedy, without building distributions
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
