"""LLaMA-family causal LM (Llama, Qwen2, Qwen3, Mistral) running on the paged KV cache.

Module and parameter names mirror Hugging Face's (model.layers.0.self_attn.q_proj.weight, ...),
so a checkpoint's state dict loads without renaming. Attention metadata is passed explicitly as a
dict[layer_name, AttentionMetadata]; every layer looks up its own entry.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from runtime.attention import AttentionBackend, AttentionMetadata, make_backend
from runtime.cpu_gemm import FusedPanels, fuse_panels
from runtime.cpu_kernels import kernels_apply
from runtime.cpu_layer import CpuLayerPlan, CpuLayerStack
from runtime.rope import RotaryEmbedding, check_rope

# The Hugging Face model types CausalLM implements (checkpoint directories and GGUF files alike).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def check_layer_config(config: PretrainedConfig, what: str, any_architecture: bool = False
                       ) -> None:
    """Refuse, naming `what` and the field, a config the layers here would misread: a
    hidden_act other than SiLU (the MLPs run SiLU, as every Llama, Qwen2/3 and Mistral
    checkpoint has), RoPE settings rope.check_rope refuses, a max_position_embeddings that is
    not a positive integer, or a sliding_window that is not a number where it is read
    (sliding_window_of)."""
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{what}'s hidden_act {act!r} is not supported (supported: silu)")
    try:
        check_rope(config)
    except ValueError as exc:
        raise ValueError(f"{what}'s {exc}") from None
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or context < 1):
        raise ValueError(f"{what}'s max_position_embeddings is {context!r}; expected a positive "
                         "integer (the context a request may grow to)")
    window = getattr(config, "sliding_window", None)
    read = any_architecture or getattr(config, "model_type", None) in _WINDOWED_MODEL_TYPES
    if read and window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"{what}'s sliding_window is {window!r}; expected an integer or null")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# the architectures whose transformers implementation applies `sliding_window`; Llama's ignores
# the key, so a Llama config that carries it (a relabelled Mistral's, say) attends to everything
_WINDOWED_MODEL_TYPES = ("qwen2", "qwen3", "mistral")


def sliding_window_of(config: PretrainedConfig, layer_index: int,
                      any_architecture: bool = False) -> int | None:
    """The layer's attention window, or None for full attention. A drafter's layers
    (`any_architecture`, Llama-style configs of our own) take the window their config gives."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    if not any_architecture and getattr(config, "model_type", None) not in _WINDOWED_MODEL_TYPES:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_index] != "sliding_attention":
        return None
    return int(window)


def layer_windows(config: PretrainedConfig, max_model_len: int,
                  any_architecture: bool = False) -> list[int | None]:
    """Each layer's window; a window that covers the whole context is full attention (None)."""
    windows = []
    for i in range(config.num_hidden_layers):
        window = sliding_window_of(config, i, any_architecture)
        windows.append(None if window is not None and window >= max_model_len else window)
    return windows


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, size]
        if x.dim() == 2 and kernels_apply(x, self.weight):
            return torch.ops.eaglebatch.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_name: str, backend_name: str,
                 sliding_window: int | None, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        in_size = input_size or config.hidden_size
        self.q_proj = nn.Linear(in_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2 has biases on q/k/v only
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        # Qwen3: each head's query and key are RMS-normalised (over head_dim) before rotary
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend: AttentionBackend = make_backend(backend_name, self.head_dim**-0.5,
                                                      sliding_window)
        self.qkv: FusedPanels | None = None  # set by fuse_for_cpu

    def fuse_for_cpu(self) -> None:
        """q, k and v in one panel product (runtime.cpu_gemm.lay_out_for_cpu calls this)."""
        self.qkv = fuse_panels([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        positions: torch.Tensor,  # [num_tokens]
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        n = x.shape[0]
        if self.qkv is not None and not torch.is_grad_enabled():
            q, k, v = self.qkv(x)  # each contiguous
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # rows of head_dim: [n * heads, head_dim] for the row kernel
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads,
                                                               self.head_dim)
        q, k = rope(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, md)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: FusedPanels | None = None  # set by fuse_for_cpu

    def fuse_for_cpu(self) -> None:
        """gate and up in one panel product (runtime.cpu_gemm.lay_out_for_cpu calls this)."""
        self.gate_up = fuse_panels([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        if torch.is_grad_enabled():  # training a drafter: autograd needs the temporaries
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate_up is not None:
            gate, up = self.gate_up(x)  # two contiguous parts of one product
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. input_size lets EAGLE-3's first draft layer take 2H inputs;
    input_norm=False gives EAGLE-1's first draft layer (no input layernorm)."""

    def __init__(self, config: PretrainedConfig, layer_name: str, backend_name: str,
                 sliding_window: int | None = None, input_size: int | None = None,
                 input_norm: bool = True) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm: nn.Module = (RMSNorm(input_size or config.hidden_size, eps)
                                           if input_norm else nn.Identity())
        self.self_attn = Attention(config, layer_name, backend_name, sliding_window, input_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)
        self.cpu_plan: CpuLayerPlan | None = None  # set by plan_for_cpu

    def plan_for_cpu(self) -> None:
        """The layer's kernels as one flat call (runtime.cpu_layer; lay_out_for_cpu calls this
        after the products are packed and fused)."""
        self.cpu_plan = CpuLayerPlan.build(self)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        residual: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        rope: RotaryEmbedding,
        kv_caches: Mapping[str, torch.Tensor],
        attn_metadata: Mapping[str, AttentionMetadata],
    ) -> torch.Tensor:  # [num_tokens, hidden_size], the residual stream after this layer
        name = self.self_attn.layer_name
        if self.cpu_plan is not None and self.cpu_plan.applies(x, positions, rope):
            return self.cpu_plan(x, residual, positions, rope, kv_caches[name], attn_metadata[name])
        h = residual + self.self_attn(self.input_layernorm(x), positions, rope, kv_caches[name],
                                      attn_metadata[name])
        return h + self.mlp(self.post_attention_layernorm(h))


class ModelOutput(NamedTuple):
    hidden_states: torch.Tensor  # [num_tokens, hidden_size], after the final norm
    aux_hidden_states: list[torch.Tensor]  # residual streams entering the requested layers


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, backend_name: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, f"layers.{i}", backend_name, sliding_window_of(config, i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, backend_name: str, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, backend_name)
        self.lm_head: nn.Module = nn.Linear(  # CPU: maybe a PrepackedLinear
            config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.q4_panels = False  # built with EngineConfig.q4_panels (runtime.setup.build_model)
        self.cpu_stack: CpuLayerStack | None = None  # set by stack_for_cpu

    @property
    def layer_names(self) -> list[str]:
        return [layer.self_attn.layer_name  # type: ignore[union-attr,misc]
                for layer in self.model.layers]

    def stack_for_cpu(self) -> None:
        """The planned layers as one C++ call (runtime.cpu_layer.CpuLayerStack;
        lay_out_for_cpu calls this after the plans)."""
        self.cpu_stack = CpuLayerStack.build(list(self.model.layers))  # type: ignore[arg-type]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: Mapping[str, torch.Tensor],
        attn_metadata: Mapping[str, AttentionMetadata],
        aux_layer_ids: tuple[int, ...] = (),
    ) -> ModelOutput:
        h = self.model.embed_tokens(input_ids)
        if self.cpu_stack is not None:
            out = self.cpu_stack.run(h, h, positions, self.rope, kv_caches, attn_metadata,
                                     aux_layer_ids)
            if out is not None:
                return ModelOutput(self.model.norm(out[0]), out[1:])
        entering: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                entering[i] = h
            h = layer(h, h, positions, self.rope, kv_caches, attn_metadata)
        return ModelOutput(self.model.norm(h), [entering[i] for i in aux_layer_ids])

    @property
    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(hidden)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]
                     | Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies a Hugging Face state dict in (a mapping, or its (name, tensor) pairs one at a
        time, each dropped once copied: runtime.loader.iter_state_dict); a name the model
        lacks, or a parameter the checkpoint lacks, is an error. Returns the names copied."""
        params = dict(self.named_parameters())
        pairs = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        seen: set[str] = set()
        ignored: set[str] = set()
        with torch.no_grad():
            for name, tensor in pairs:
                if name in params:
                    if params[name].shape != tensor.shape:
                        raise ValueError(
                            f"checkpoint does not match its config.json: {name} has shape "
                            f"{tuple(tensor.shape)}, the config gives {tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    seen.add(name)
                elif "rotary_emb" not in name:
                    ignored.add(name)
        missing = set(params) - seen
        if getattr(self.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
        if missing or ignored:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(ignored)[:5]}")
        return seen

    def untie_head(self) -> None:
        """A head of its own, so that load_weights can read a head the checkpoint stores;
        tie_head then ties it as the checkpoint says."""
        weight = self.model.embed_tokens.weight
        if self.lm_head.weight is weight:
            self.lm_head.weight = nn.Parameter(torch.empty_like(weight))

    def tie_head(self, loaded: set[str], source: object) -> None:
        """After load_weights (which returned `loaded`): the head is the embedding where
        config.json ties them (tie_word_embeddings), unless the checkpoint (`source`, named in
        a note) holds a head of other values, which transformers then keeps, untied (and
        warns); so is it here."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return
        head, embedding = self.lm_head.weight, self.model.embed_tokens.weight
        assert isinstance(head, torch.Tensor)
        if "lm_head.weight" in loaded and not torch.equal(head, embedding):
            print(f"note: {source} ties the LM head to the embedding (tie_word_embeddings), but "
                  "its weights hold a head of other values: that head is used, untied, as "
                  "transformers does; set tie_word_embeddings to false to say so",
                  file=sys.stderr)
            return
        self.lm_head.weight = embedding
