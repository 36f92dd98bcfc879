"""Attention backends behind one metadata dataclass."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.attention.cpu_backend import CpuAttentionBackend
from runtime.attention.flash_backend import FlashAttentionBackend, load_flash_attn
from runtime.attention.metadata import AttentionMetadata, build_attention_metadata
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.config import PlacementError
from runtime.cpu_kernels import load_cpu_kernels

__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata",
           "choose_backend_name", "make_backend"]


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor: ...


def choose_backend_name(requested: str, device: torch.device) -> str:
    """auto: flash on CUDA when flash-attn imports; on the CPU, cpu when its kernel builds;
    else torch."""
    if requested == "flash" and (device.type != "cuda" or load_flash_attn() is None):
        raise PlacementError("--attention-backend flash needs CUDA and the flash-attn package "
                           "(pip install -e .[gpu])")
    if requested == "cpu" and (device.type != "cpu" or not load_cpu_kernels()):
        raise PlacementError("--attention-backend cpu needs the CPU device and a C++ compiler "
                           "to build its kernel (see the warning above)")
    if requested == "auto":
        if device.type == "cuda":
            return "flash" if load_flash_attn() is not None else "torch"
        return "cpu" if load_cpu_kernels() else "torch"
    return requested


def make_backend(name: str, scale: float, sliding_window: int | None) -> AttentionBackend:
    if name == "flash":
        return FlashAttentionBackend(scale, sliding_window)
    if name == "cpu":
        return CpuAttentionBackend(scale, sliding_window)
    return TorchAttentionBackend(scale, sliding_window)
