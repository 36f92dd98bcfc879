"""Per-request sampling parameters as tensors, and the target distribution they define.

The runner builds one SamplingTensors per step (make_sampling_tensors), turns the target's logits
into probabilities with target_probs(), and hands those with each token's uniform
(position_uniforms) to sample_and_verify(), which emits every token: plain decoding is
verification with zero draft tokens. token_logprobs() gives the emitted tokens' log-probabilities
(SamplingParams.logprobs) and the most likely tokens' (SamplingParams.top_logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from runtime.config import GREEDY_BELOW, MAX_TOP_LOGPROBS
from runtime.request import TopLogprobs


class SamplingTensors(NamedTuple):
    """Sampling parameters of the requests in a batch, one entry per request."""

    temperature: Tensor  # [batch] float32, below GREEDY_BELOW = greedy
    top_k: Tensor  # [batch] int64, 0 = off
    top_p: Tensor  # [batch] float32, 1 = off
    greedy: Tensor  # [batch] bool
    # Host-side flag: some row uses top-k or top-p. False lets target_probs skip the vocab sort
    # without reading the tensors back from the device.
    filtered: bool = True
    min_p: Tensor | None = None  # [batch] float32, 0 = off; None: off for every row


def make_sampling_tensors(
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    device: torch.device | str,
    min_p: Sequence[float] | None = None,
) -> SamplingTensors:
    """One host-to-device copy per field; nothing is read back."""
    if not len(temperature) == len(top_k) == len(top_p):
        raise ValueError(f"got {len(temperature)} temperatures, {len(top_k)} top_k and "
                         f"{len(top_p)} top_p values; need one of each per request")
    filtered = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
    temp = torch.tensor(temperature, dtype=torch.float32, device=device)
    return SamplingTensors(
        temperature=temp,
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        # as SamplingParams.greedy decides it, in float64: a float32 1e-5 is below 1e-5 there
        greedy=torch.tensor([t < GREEDY_BELOW for t in temperature], dtype=torch.bool,
                            device=device),
        filtered=filtered,
        min_p=(torch.tensor(min_p, dtype=torch.float32, device=device)
               if min_p is not None and any(p > 0 for p in min_p) else None),
    )


def position_uniforms(seeds: Sequence[int | None], starts: Sequence[int], width: int,
                      device: torch.device | str) -> Tensor:
    """[batch, width] float64 in [0, 1): row b's j-th is the uniform for the token at index
    starts[b] + j of request b's sequence (prompt included), which draw_tokens turns into a
    token. For a seeded request it is a hash of (seed, index): a seeded request draws the same
    for each of its tokens whatever else runs, however many drafts a step verifies, and after a
    preemption. Unseeded requests draw from torch's global RNG."""
    if not len(seeds) == len(starts):
        raise ValueError(f"got {len(seeds)} seeds and {len(starts)} starts")
    out = torch.empty(len(seeds), width, dtype=torch.float64)
    unseeded = [b for b, seed in enumerate(seeds) if seed is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), width, dtype=torch.float64)
    for b, (seed, start) in enumerate(zip(seeds, starts, strict=True)):
        if seed is not None:
            out[b] = torch.tensor([_uniform(seed, start + j) for j in range(width)],
                                  dtype=torch.float64)
    return out.to(device)


_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) from the top 53 bits of a hash of (seed, index)."""
    z = _mix((_mix(seed & _MASK) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK)
    return (z >> 11) / float(1 << 53)


def target_probs(logits: Tensor, st: SamplingTensors, positions_per_row: int) -> Tensor:
    """Target distributions after temperature, then min-p, then top-k, then top-p.

    logits: [batch * positions_per_row, vocab], the rows of one request adjacent
      (request b owns rows b * positions_per_row ... (b + 1) * positions_per_row - 1).
    Returns [batch, positions_per_row, vocab] float32. Greedy rows get a one-hot at the argmax
    of the raw logits, so sample_and_verify treats every row the same way.
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (the top
    token is always kept); top-k keeps exactly k tokens (ties broken by vocab order); min-p drops
    the tokens less likely than min_p times the most likely one (as vLLM's min_p).
    """
    rows, vocab = logits.shape
    batch = rows // positions_per_row
    if batch * positions_per_row != rows:
        raise ValueError(f"{rows} logit rows is not a multiple of positions_per_row="
                         f"{positions_per_row}")
    logits = logits.float()

    def per_row(t: Tensor) -> Tensor:  # [batch] -> [rows, 1]
        return t.repeat_interleave(positions_per_row).unsqueeze(-1)

    greedy = per_row(st.greedy)  # [rows, 1]
    temperature = torch.where(greedy, 1.0, per_row(st.temperature))  # greedy: avoid 0-division
    scaled = logits / temperature
    if st.min_p is not None:
        scaled = _min_p_logits(scaled, per_row(st.min_p))
    if st.filtered:  # (a greedy row's filters are moot: it gets a one-hot below)
        probs = _top_k_top_p_probs(scaled, torch.where(greedy, 0, per_row(st.top_k)),
                                   torch.where(greedy, 1.0, per_row(st.top_p)))
    else:
        probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs).view(batch, positions_per_row, vocab)


def _min_p_logits(scaled: Tensor, min_p: Tensor) -> Tensor:
    """`scaled` with -inf for the tokens whose probability is below min_p times the row's
    largest (min_p [rows, 1], 0 = off). Row by row: a softmax and a max of the row alone."""
    probs = torch.softmax(scaled, dim=-1)
    low = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(low, float("-inf"))


# Tokens a top-k / top-p row is sorted among, tried in turn: its top ones by torch.topk, not the
# whole vocabulary (sorting 49k logits for 32 rows took 160-185 ms a step, one thread; topk of
# 256 / 1,024 of them 7 / 15 ms)
CANDIDATES = (256, 1024)


def _top_k_top_p_probs(
    scaled: Tensor,  # [rows, vocab] float32, temperature already applied
    top_k: Tensor,  # [rows, 1] int64, 0 = off
    top_p: Tensor,  # [rows, 1] float32, 1 = off
) -> Tensor:  # [rows, vocab] float32
    """Each row by the cheapest route that gives its exact filtered distribution, chosen from
    that row alone (so a seeded row draws alike whatever else is in the batch):
    - no filter (top_k off, top_p 1): a softmax;
    - the first of CANDIDATES whose most likely tokens hold the distribution (top_k at most
      their number, or top_k off and their mass reaching top_p), with no token outside them
      tied with the last: those are sorted;
    - else the whole vocabulary is.
    (A host sync for each route tried, in steps that filter.)"""
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [rows, 1]
    out = torch.softmax(scaled, dim=-1)
    todo = ~((k >= vocab) & (top_p >= 1.0)).squeeze(-1)  # [rows]
    for size in CANDIDATES:
        at = todo.nonzero().squeeze(-1)
        if not len(at):
            return out
        probs, fast = _among_candidates(scaled[at], out[at], k[at], top_p[at], min(size, vocab))
        out[at[fast]] = probs[fast]
        todo[at[fast]] = False
    at = todo.nonzero().squeeze(-1)
    if len(at):
        out[at] = _sorted_vocab_probs(scaled[at], top_k[at], top_p[at])
    return out


def _among_candidates(
    scaled: Tensor,  # [rows, vocab] float32
    full: Tensor,  # [rows, vocab] float32, softmax(scaled)
    k: Tensor,  # [rows, 1] int64, top_k (vocab where off)
    top_p: Tensor,  # [rows, 1] float32
    candidates: int,
) -> tuple[Tensor, Tensor]:  # [rows, vocab] float32, [rows] bool: where the first is right
    values, ids = scaled.topk(candidates, dim=-1)  # [rows, candidates], ties in no set order
    # (a last candidate of -inf: every token left by min-p is among them)
    untied = ((scaled >= values[:, -1:]).sum(-1) == candidates) | values[:, -1].isneginf()
    # the candidates in sorted() order: by logit, ties by id (sort by id, then stably by logit)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_value)
    # their probabilities under top-k: within them where k <= candidates, else over the whole
    # vocabulary (right for top-k off; a k between the two goes another way). (softmax, not a
    # logsumexp: a reduction over one row may be split among threads when the row is alone, and
    # then sum in another order than in a batch)
    vocab = scaled.shape[-1]
    inside = k <= candidates
    values = values.masked_fill(torch.arange(candidates, device=scaled.device) >= k,
                               float("-inf"))
    probs = torch.where(inside, torch.softmax(values, dim=-1), full.gather(-1, ids))
    mass = probs.cumsum(dim=-1)
    short = inside | ((k >= vocab) & (mass[:, -1:] >= top_p))  # the candidates decide top-p
    drop = (mass - probs >= top_p) & (top_p < 1.0)
    kept = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(scaled).scatter_(-1, ids, kept), untied & short.squeeze(-1)


def _sorted_vocab_probs(
    scaled: Tensor,  # [rows, vocab] float32, temperature already applied
    top_k: Tensor,  # [rows, 1] int64, 0 = off
    top_p: Tensor,  # [rows, 1] float32, 1 = off
) -> Tensor:  # [rows, vocab] float32
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)  # [vocab]
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    # top-p on the top-k distribution: drop a token when the mass strictly before it already
    # reaches top_p. Example p = [0.5, 0.3, 0.2], top_p = 0.7: mass before = [0, 0.5, 0.8]
    # -> keep the first two. rank 0 (mass before = 0) is never dropped.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p) & (top_p < 1.0)  # top_p = 1: keep all, whatever the rounding
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.zeros_like(scaled).scatter_(-1, order, torch.softmax(sorted_logits, dim=-1))


class TokenLogprobs(NamedTuple):
    """One request's log-probabilities in one step: each emitted token's (SamplingParams.logprobs)
    and, where asked (SamplingParams.top_logprobs), the most likely tokens where each was drawn."""

    values: list[float]
    top: list[TopLogprobs] | None


def token_logprobs(logits: Tensor,  # [rows, vocab] float32, the raw logits
                   rows_per_request: list[int], tokens: list[list[int]],
                   top_n: list[int | None]) -> list[TokenLogprobs | None]:
    """The log-softmax of each emitted token's logits row, at that token and (top_n[b] > 0) at
    the row's top_n[b] most likely tokens, for the requests that want them (top_n[b] not None).
    Request b owns rows_per_request[b] consecutive rows of `logits`, and its i-th emitted token
    was drawn from its i-th row."""
    index: list[int] = []  # the rows of the emitted tokens that want log-probabilities
    picked: list[int] = []  # those tokens
    starts: list[int] = []  # where each wanting request's tokens begin among them
    start = 0
    for n, toks, top in zip(rows_per_request, tokens, top_n, strict=True):
        if top is not None:
            starts.append(len(index))
            index += range(start, start + len(toks))
            picked += toks
        start += n
    # a row's log-softmax is computed from that row alone: the same bits in any batch
    rows = torch.log_softmax(logits.index_select(0, torch.tensor(index, device=logits.device)),
                             dim=-1)
    values = rows.gather(1, torch.tensor(picked, device=logits.device).unsqueeze(1)
                         ).squeeze(1).tolist()
    most = (_most_likely(rows, min(MAX_TOP_LOGPROBS, rows.shape[-1]))
            if any(top_n) else None)
    out: list[TokenLogprobs | None] = []
    at = iter(starts)
    for toks, top in zip(tokens, top_n, strict=True):
        if top is None:
            out.append(None)
            continue
        first = next(at)
        span = slice(first, first + len(toks))
        out.append(TokenLogprobs(values[span], None if not top or most is None
                                 else [r[:top] for r in most[span]]))
    return out


def _most_likely(logprobs: Tensor,  # [rows, vocab] float32
                 k: int) -> list[TopLogprobs]:
    """Each row's k largest values with their ids, largest first and, among equal values, the
    lowest id first (as a stable sort of the row would give): a function of the row alone."""
    values, ids = logprobs.topk(k, dim=-1)
    # where tokens outside the k tie with the k-th, topk's choice among them is its own: take
    # the lowest ids, from a stable sort of those rows
    tied = ((logprobs >= values[:, -1:]).sum(dim=-1) > k).nonzero().squeeze(1)
    if tied.numel():
        sorted_values, order = logprobs.index_select(0, tied).sort(dim=-1, descending=True,
                                                                   stable=True)
        values[tied], ids[tied] = sorted_values[:, :k], order[:, :k]
    return [tuple(sorted(zip(i, v, strict=True), key=lambda pair: (-pair[1], pair[0])))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
