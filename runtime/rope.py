"""Rotary position embeddings, precomputed as one cos/sin table indexed by position.

The inverse frequencies (including llama3, linear and yarn scaling) come from transformers'
ROPE_INIT_FUNCTIONS, so any rope_parameters a checkpoint declares are read the same way it was
trained with. 'dynamic' and 'longrope' scaling depend on the running length and are refused.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from runtime.cpu_kernels import kernels_apply


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_type", params.get("type", "default"))
    return params


# the rope_parameters (or config) fields that are numbers, where a config gives them
_NUMBERS = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
            "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
            "mscale_all_dim")


def check_rope(config: PretrainedConfig) -> None:
    """Refuse RoPE settings the rotary embedding cannot read, naming the field (rather than a
    KeyError or TypeError from deep in transformers): scaling whose frequencies change with the
    length, an unknown rope_type, a field that should be a number and is not."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type in ("dynamic", "longrope"):  # transformers recomputes these as lengths grow
        raise ValueError(f"rope_type {rope_type!r} is not supported (its frequencies change with "
                         "the sequence's length)")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        known = sorted({"default", *ROPE_INIT_FUNCTIONS} - {"dynamic", "longrope"})
        raise ValueError(f"rope_type {rope_type!r} is not a RoPE type (supported: "
                         f"{', '.join(known)})")
    values = {"rope_theta": getattr(config, "rope_theta", None), **params}
    for key in _NUMBERS:
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{key} is {value!r}; expected a number")


def context_length(config: PretrainedConfig) -> int:
    """The model's context, as vLLM derives it: max_position_embeddings, times the factor of
    linear scaling; with yarn scaling, its original context times its factor (Qwen2.5's and
    Qwen3's model cards turn yarn on over the original context)."""
    check_rope(config)
    length = int(config.max_position_embeddings)
    params = rope_parameters(config)
    factor = float(params.get("factor") or 1.0)
    if params["rope_type"] == "yarn":
        return int(int(params.get("original_max_position_embeddings") or length) * factor)
    if params["rope_type"] == "linear":
        return int(length * factor)
    return length


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] float32 inverse frequencies, attention scaling)."""
    check_rope(config)
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type == "default":
        theta = rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)
        # a GGUF's per-frequency divisors (llama.cpp's rope_freqs) other than Llama 3's scaling
        divisors = getattr(config, "rope_freq_divisors", None)
        if divisors is not None:
            if len(divisors) != len(inv_freq):
                raise ValueError(f"rope_freq_divisors has {len(divisors)} values for "
                                 f"{len(inv_freq)} rotary frequencies")
            inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32)
        return inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor  # [max_positions, head_dim]

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # computed, never loaded: also when built under "meta"
            inv_freq, scaling = inverse_frequencies(config, head_dim)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)  # [max_pos, head_dim]
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.is_contiguous() and kernels_apply(q, k, self.cos, self.sin):
            return torch.ops.eaglebatch.rope(q, k, self.cos, self.sin, positions)
        cos, sin = self._lookup(positions, q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forget(self) -> None:
        """Drop the rows looked up last: the next call looks them up again even for the same
        positions tensor (a tensor refilled in place, as the static buffers of CUDA graphs)."""
        self._last = None

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions, [num_tokens, 1, head_dim] each. Every layer of a forward
        pass gets the same positions tensor, so the rows are looked up once per pass."""
        key = (positions, dtype)
        if self._last is None or self._last[0] is not positions or self._last[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._last = (*key, cos, sin)
        return self._last[2], self._last[3]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
