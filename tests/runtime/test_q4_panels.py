"""4-bit panels (runtime.weight_panels.q4_panels): built only where every float32 weight is exactly
a Q4_1 value fma(d, q, m), and then their products are the float32 panels' bits, whole-model
tokens included."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_gemm import Q4_ROWS, PrepackedLinear, fuse_panels, prepack, q4_weight_count
from runtime.cpu_kernels import load_cpu_kernels
from runtime.engine import Engine
from runtime.request import GenerationRequest
from runtime.weight_panels import pack_panels, q4_panels


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"


def q4_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Weights as llama.cpp's Q4_1 leaves them: per 32 inputs of an output, float16 d and m,
    q in 0..15 with 0 and 15 both present, each weight fma(d, q, m) in float32."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    low = (torch.randn(out_features, blocks, 1, generator=g) * 0.05).half().double()
    d = (torch.rand(out_features, blocks, 1, generator=g) * 0.01).half().double()
    q = torch.randint(0, 16, (out_features, blocks, 32), generator=g).double()
    q[..., 0], q[..., 1] = 0, 15  # the block's least and greatest values, as quantized
    return (d * q + low).float().reshape(out_features, in_features)


@pytest.mark.parametrize("out_features", [192, 200])  # whole panels, and a part-filled one
def test_q4_products_are_the_float32_panels_bits(out_features: int) -> None:
    weight, bias = q4_weight(out_features, 96, 0), torch.randn(out_features)
    q4 = q4_panels(weight)
    assert q4 is not None
    nibbles, dm = q4
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (-(-out_features // 64), 96, 32)
    panels = pack_panels(weight)
    g = torch.Generator().manual_seed(1)
    for rows in range(1, Q4_ROWS + 1):
        x = torch.randn(rows, 96, generator=g) * 3
        want = torch.ops.eaglebatch.panel_linear(x, panels, bias, out_features)
        got = torch.ops.eaglebatch.panel_linear_q4(x, nibbles, dm, bias, out_features)
        assert torch.equal(got, want), rows
    with pytest.raises(RuntimeError, match=r"\[1..12, K\]"):
        torch.ops.eaglebatch.panel_linear_q4(torch.randn(Q4_ROWS + 1, 96), nibbles, dm, bias,
                                             out_features)


def test_fused_q4_parts_and_the_linear_use_them_up_to_q4_rows() -> None:
    parts = []
    for i, n in enumerate([128, 64, 64]):  # q, k and v of a fused product
        linear = nn.Linear(96, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(q4_weight(n, 96, 10 + i))
        packed = prepack(linear, q4=True)
        assert isinstance(packed, PrepackedLinear) and packed._q4 is not None
        parts.append(packed)
    plain = [prepack(nn.Linear(96, 64)) for _ in range(2)]
    assert all(isinstance(p, PrepackedLinear) and p._q4 is None for p in plain)  # not Q4_1
    fused = fuse_panels(parts)
    assert fused is not None and fused._q4 is not None
    for rows in (1, 4, Q4_ROWS + 2):  # the last runs on the float32 panels
        x = torch.randn(rows, 96)
        got = fused(x)
        want = torch.ops.eaglebatch.panel_linear_parts(x, fused._packed, None, fused.splits,
                                                       None)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_only_exact_q4_weights_get_them() -> None:
    weight = q4_weight(64, 64, 2)
    assert q4_panels(weight) is not None
    off = weight.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1.0))  # one ulp away
    assert q4_panels(off) is None
    assert q4_panels(q4_weight(64, 64, 3)[:, :48]) is None  # inputs not whole blocks of 32
    assert q4_panels(torch.randn(64, 64)) is None
    linear = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    packed = prepack(linear)  # q4 not asked for
    assert isinstance(packed, PrepackedLinear) and packed._q4 is None


def test_default_model_tokens_are_the_same_with_q4_panels(smollm2_dir: Path) -> None:
    """The default model's decoder is Q4_1 in its GGUF file: every layer's four products get
    4-bit panels, and greedy tokens with and without them (plain and drafted) are equal."""
    prompts = [[1, 504, 3458, 314, 253, 1345, 30], [1, 19556, 17, 1073, 359, 346, 47, 216]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = []
    for q4 in (False, True):
        engine = Engine(EngineConfig(model=str(smollm2_dir), q4_panels=q4, max_num_seqs=2,
                                     kv_cache_memory=64 << 20))
        plans = [layer.cpu_plan for layer in engine.model.model.layers]  # type: ignore[union-attr]
        assert all((p is not None and p.q4 is not None) == q4 for p in plans)
        # q, k, v, o, gate, up, down of 30 layers (what bench's report states)
        assert q4_weight_count(engine.model.model) == ((210 if q4 else 0), 210)
        done = engine.generate([GenerationRequest(str(i), p, params)
                                for i, p in enumerate(prompts)])
        outputs.append({c.request_id: c.token_ids for c in done})
    assert outputs[0] == outputs[1] and all(len(t) == 24 for t in outputs[0].values())


def test_a_model_whose_weights_are_not_q4_gets_no_4_bit_panels(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), q4_panels=True,
                                 kv_cache_memory=1 << 20))
    assert q4_weight_count(engine.model.model) == (0, 14)  # 2 layers of 7 random float32 matrices
