"""Building an engine's parts from an EngineConfig: device, dtype, model, drafter, KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from runtime.attention import choose_backend_name
from runtime.attention.flash_backend import FLASH_BLOCK_SIZE
from runtime.config import EngineConfig, PlacementError
from runtime.cpu_gemm import PrepackedLinear, lay_out_for_cpu
from runtime.greedy_head import ExactGreedyHead
from runtime.host_memory import return_freed_memory
from runtime.kv.cache import allocate_kv_caches
from runtime.kv.groups import (
    KVCacheBudgetError,
    KVCacheConfig,
    make_kv_cache_config,
    validate_same_kv_cache_group,
)
from runtime.kv.spec import AttentionSpec
from runtime.loader import iter_state_dict
from runtime.model import (
    SUPPORTED_MODEL_TYPES,
    CausalLM,
    check_layer_config,
    head_dim_of,
    layer_windows,
)
from runtime.rope import RotaryEmbedding

CPU_DEFAULT_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Placement(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    backend: str
    block_size: int


def place(config: EngineConfig) -> Placement:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise PlacementError("--device cuda was asked for but torch sees no CUDA device")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if use_cuda else torch.float32
    else:
        dtype = _DTYPES[config.dtype]
    backend = choose_backend_name(config.attention_backend, device)
    if config.cuda_graphs and device.type != "cuda":  # refused before a model is loaded
        raise PlacementError(f"--cuda-graphs needs a CUDA device (this engine runs on "
                             f"{device.type})")
    if config.cuda_graphs and backend != "torch":
        raise PlacementError(f"--cuda-graphs needs --attention-backend torch (this engine runs "
                             f"{backend})")
    block_size = config.block_size
    if backend == "flash" and block_size % FLASH_BLOCK_SIZE:
        block_size = FLASH_BLOCK_SIZE  # flash-attn's paged KV wants multiples of 256
    return Placement(device, dtype, backend, block_size)


def build_model(model_dir: Path, hf_config: PretrainedConfig, p: Placement,
                max_positions: int, q4: bool = False) -> CausalLM:
    """q4: 4-bit panels where the weights allow them (EngineConfig.q4_panels)."""
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {hf_config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    check_layer_config(hf_config, "the model")
    with torch.device("meta"):
        model = CausalLM(hf_config, p.backend, max_positions).to(p.dtype)
    model = model.to_empty(device=p.device)  # in its dtype: no float32 copy of 16-bit weights
    # rope tables are computed, not loaded: rebuild them off the meta device
    model.rope = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_positions).to(p.device)
    model.untie_head()  # (to_empty has untied it already)
    loaded = model.load_weights(iter_state_dict(model_dir, p.dtype, p.device))  # one at a time
    model.tie_head(loaded, model_dir)
    model = model.to(p.dtype).eval()
    if p.device.type == "cpu":
        lay_out_for_cpu(model, q4=q4, release_weights=True)
        _release_head_weight(model)
    model.q4_panels = q4
    return model


def _release_head_weight(model: CausalLM) -> None:
    """An untied head lets go of its weight too, once the exact greedy head (whose int8 and
    bfloat16 copies are made from it) is built: the packed copy runs every product. A head tied
    to the embedding shares its weight, which the lookups read."""
    head = model.lm_head
    if isinstance(head, PrepackedLinear) and head.weight is not model.model.embed_tokens.weight:
        ExactGreedyHead.for_head(head)  # cached on the head for every engine on this model
        head.release_weight()
        return_freed_memory()


def attention_specs(hf_config: PretrainedConfig, names: list[str], block_size: int,
                    dtype: torch.dtype, window_of: list[int | None]) -> dict[str, AttentionSpec]:
    return {name: AttentionSpec(block_size, hf_config.num_key_value_heads, head_dim_of(hf_config),
                                dtype.itemsize, window)
            for name, window in zip(names, window_of, strict=True)}


def target_specs(hf_config: PretrainedConfig, model: CausalLM, p: Placement,
                 max_model_len: int) -> dict[str, AttentionSpec]:
    windows = layer_windows(hf_config, max_model_len)
    return attention_specs(hf_config, model.layer_names, p.block_size, p.dtype, windows)


def kv_budget(config: EngineConfig, p: Placement) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if p.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(p.device)
        return int(free * config.gpu_memory_fraction)
    return CPU_DEFAULT_KV_BYTES


def build_kv_cache(specs: dict[str, AttentionSpec], draft_names: list[str], budget: int,
                   p: Placement) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    # A target mixing sliding-window and full layers (a Qwen2 with max_window_layers) has one
    # group of each; their pages have one layout and a request has one block table over every
    # layer (runtime.kv.manager): a sliding layer's window is its attention's mask, and it keeps
    # the blocks that left its window like a full layer does.
    kv_config = make_kv_cache_config(specs, budget, draft_names)
    if draft_names:
        validate_same_kv_cache_group(kv_config)  # before any cache tensor exists
    try:
        caches = allocate_kv_caches(kv_config, p.dtype, p.device)
    except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise KVCacheBudgetError(f"cannot allocate a KV cache of {budget} bytes on {p.device} "
                                 f"({reason})") from None
    return kv_config, caches
