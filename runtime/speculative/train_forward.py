"""Training-time forward of an EagleDrafter: full causal attention with torch SDPA, no paged cache.

It runs the SAME modules as the paged forward (fc, each layer's norms, q/k/v/o projections and MLP,
the rope table); only the attention differs: SDPA over padded [batch, time] sequences instead of
the paged cache. `unrolled_forward` also runs the "training-time test": steps 2..k feed the
drafter's own output back as the feature, the way the proposer drafts.

Rows are indexed by anchor p (the last position the target verified). Step j (0-based) of anchor p
sits at position p + j, takes the token at p + j + 1 and (j = 0) the target's feature at p or
(j > 0) the drafter's step j - 1 output for anchor p; it predicts the feature at p + j + 1.
Its query sees step 0's keys at positions <= p (the drafter's KV over verified tokens) and the
keys of steps 1..j of the same anchor (its own earlier drafts), as in the paged cache:

    keys:       step 0 (T)        step 1 (T)    step 2 (T)
    step 0   causal (k <= q)         -             -
    step 1   causal (k <= q)     diag (k == q)     -
    step 2   causal (k <= q)     diag (k == q)  diag (k == q)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model import DecoderLayer
from runtime.speculative.drafter import EagleDrafter

KV = tuple[torch.Tensor, torch.Tensor]  # ([B, kv_heads, T, D], [B, kv_heads, T, D])


def step_mask(step: int, length: int, device: torch.device) -> torch.Tensor:
    """[T, (step + 1) * T] bool, True = may attend (see the module docstring)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diag = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def _layer_forward(layer: DecoderLayer, drafter: EagleDrafter, x: torch.Tensor,
                   residual: torch.Tensor, positions: torch.Tensor, past: list[KV],
                   mask: torch.Tensor) -> tuple[torch.Tensor, KV]:
    """x: [B, T, in], residual: [B, T, H], positions: [B, T] -> ([B, T, H], this step's KV)."""
    attn = layer.self_attn
    b, t, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b * t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(h).view(b * t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    assert drafter.rope is not None
    q, k = drafter.rope(positions.reshape(-1), q, k)
    q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    keys = torch.cat([kv[0] for kv in past] + [k], dim=2)
    values = torch.cat([kv[1] for kv in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True,
                                         scale=attn.head_dim**-0.5)
    h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.num_heads * attn.head_dim))
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k, v)


def _step_forward(drafter: EagleDrafter, input_ids: torch.Tensor, positions: torch.Tensor,
                  features: torch.Tensor, past: list[list[KV]], mask: torch.Tensor
                  ) -> tuple[torch.Tensor, list[KV]]:
    """One draft step for every anchor; past[i] holds layer i's KV of the earlier steps."""
    x, residual = drafter.layer_inputs(input_ids, features)  # [B, T, in], [B, T, H]
    new_kv = []
    for layer, layer_past in zip(drafter.layers, past, strict=True):
        assert isinstance(layer, DecoderLayer)
        residual, kv = _layer_forward(layer, drafter, x, residual, positions, layer_past, mask)
        new_kv.append(kv)
        x = residual
    return residual, new_kv


def unrolled_forward(drafter: EagleDrafter, token_ids: torch.Tensor, features: torch.Tensor,
                     num_steps: int) -> list[torch.Tensor]:
    """token_ids: [B, T] (right-padded sequences), features: [B, T, F] the target's features.
    Returns num_steps hidden states [B, T, H]; entry j row p predicts the feature at p + j + 1
    (rows whose inputs run past the sequence are garbage; the loss masks them)."""
    b, t = token_ids.shape
    device = token_ids.device
    pos = torch.arange(t, device=device).expand(b, t)
    padded = F.pad(token_ids, (0, num_steps))  # [B, T + num_steps]
    past: list[list[KV]] = [[] for _ in drafter.layers]
    hidden: list[torch.Tensor] = []
    feats = features
    for j in range(num_steps):
        ids = padded[:, j + 1:j + 1 + t]  # the token at p + j + 1
        out, kv = _step_forward(drafter, ids, pos + j, feats, past, step_mask(j, t, device))
        for layer_past, layer_kv in zip(past, kv, strict=True):
            layer_past.append(layer_kv)
        hidden.append(out)
        feats = out
    return hidden
