"""The C++ rms_norm and rope kernels against the torch paths they replace on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from runtime.cpu_kernels import load_cpu_kernels
from runtime.model import MLP, RMSNorm
from runtime.rope import RotaryEmbedding, _rotate_half


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"


def _torch_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def test_rope_kernel_gives_torchs_bits() -> None:
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=300,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    rope = RotaryEmbedding(config, 64, 300)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(37, 9, 64, generator=generator)
    k = torch.randn(37, 3, 64, generator=generator)
    positions = torch.randint(0, 300, (37,), generator=generator)
    with torch.inference_mode():
        got_q, got_k = rope(positions, q, k)
        cos, sin = rope._lookup(positions, q.dtype)
    assert torch.equal(got_q, q * cos + _rotate_half(q) * sin)
    assert torch.equal(got_k, k * cos + _rotate_half(k) * sin)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the table of 300"):
        rope(torch.full((37,), 300), q, k)


def _lane_tree_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm's arithmetic written out in float32 (numpy scalars: each operation rounded
    once): squares summed in 16 lanes (lane l takes values l, l + 16, ...), the lanes by the
    pairwise tree l + 8, + 4, + 2, + 1, the tail in order, then weight * (x * (1 / sqrt(sum / n
    + eps)))."""
    f32 = np.float32
    n = x.shape[-1]
    whole = n - n % 16
    rows = []
    for row in x.numpy():
        squares = row * row
        lanes = np.zeros(16, dtype=f32)
        for j in range(0, whole, 16):
            lanes = lanes + squares[j:j + 16]
        for width in (8, 4, 2, 1):
            lanes = lanes[:width] + lanes[width:2 * width]
        total = lanes[0]
        for j in range(whole, n):
            total = f32(total + squares[j])
        scale = f32(1) / np.sqrt(f32(total / f32(n)) + f32(eps))
        rows.append(weight.numpy() * (row * scale))
    return torch.from_numpy(np.stack(rows))


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
                    reason="the 16-lane sum is the AVX2 and AVX-512 kernels' (the portable "
                           "loop sums in order)")
@pytest.mark.parametrize("size", [576, 100, 7])
def test_rms_norm_kernel_sums_squares_in_sixteen_lanes_on_avx2_and_avx512(size: int) -> None:
    """The same bits on CPUs with AVX2 and with AVX-512 (on AVX2 the sum was sequential)."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(size, generator=generator)
    x = torch.randn(20, size, generator=generator) * 3
    got = torch.ops.eaglebatch.rms_norm(x, weight, 1e-5)
    assert torch.equal(got, _lane_tree_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("size", [576, 100, 7])
def test_rms_norm_kernel_is_torchs_up_to_the_sum_order_and_rows_are_independent(
        size: int) -> None:
    norm = RMSNorm(size, 1e-5)
    generator = torch.Generator().manual_seed(1)
    norm.weight.data = torch.randn(size, generator=generator)
    x = torch.randn(50, size, generator=generator) * 3
    with torch.inference_mode():
        got = norm(x)
        alone = torch.cat([norm(x[i:i + 1]) for i in range(50)])
    assert torch.equal(got, alone)
    torch.testing.assert_close(got, _torch_rms_norm(norm, x), rtol=2e-6, atol=2e-6)
    # with autograd on (training a drafter) the torch path runs and gradients flow
    x.requires_grad_(True)
    norm(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_mlp_in_place_path_equals_the_autograd_path() -> None:
    config = LlamaConfig(hidden_size=64, intermediate_size=160)
    mlp = MLP(config)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        fast = mlp(x)
    with torch.enable_grad():
        slow = mlp(x)
    assert torch.equal(fast, slow.detach())
