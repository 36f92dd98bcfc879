"""CPU weight layouts of a model's Linears: values and parameter identity unchanged, products
equal F.linear on every kernel (BLAS outside the packed row range; panel_linear or oneDNN inside
it), bfloat16 and int8 panels give the float32 panels' bits, released weights leave one copy,
fused panels give each part its own bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from runtime.config import EngineConfig
from runtime.cpu_gemm import (
    ONEDNN_DECODER_ROWS,
    PANEL_ROWS,
    PrepackedLinear,
    fuse_panels,
    lay_out_for_cpu,
    prepack,
    transpose_linear_weights,
)
from runtime.cpu_kernels import load_cpu_kernels
from runtime.engine import Engine
from runtime.model import CausalLM
from runtime.weight_panels import pack_panels, quantize_int8


def test_transpose_keeps_values_and_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    x = torch.randn(5, 8)
    want = model(x)
    transpose_linear_weights(model)
    assert [id(p) for p in model.parameters()] == params
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not model[0].weight.is_contiguous() and model[0].weight.t().is_contiguous()
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


def test_prepacked_head_matches_linear_and_keeps_tied_weight() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(1000, 32)
    head = nn.Linear(32, 1000, bias=False)
    head.weight = embed.weight
    packed = prepack(head, head=True)
    x = torch.randn(7, 32)
    assert isinstance(packed, PrepackedLinear) and packed.rows == PANEL_ROWS
    assert packed.weight is embed.weight
    assert packed.out_features == 1000
    torch.testing.assert_close(packed(x), F.linear(x, embed.weight), rtol=1e-4, atol=1e-4)
    assert packed(x[:0]).shape == (0, 1000)


@pytest.mark.parametrize("rows", [1, 2, 5, 48, 100])
def test_packed_decoder_linear_with_bias_matches_on_both_sides_of_the_range(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 70)  # 70 outputs: a full panel of 64 and a partial one
    want_layer = nn.Linear(24, 70)
    want_layer.load_state_dict(linear.state_dict())
    layer = prepack(linear)
    assert isinstance(layer, PrepackedLinear) and layer.kernel == "panel"
    assert layer.bias is linear.bias and layer.weight is linear.weight
    x = torch.randn(rows, 24)
    torch.testing.assert_close(layer(x), want_layer(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 24)), want_layer(x).view(1, rows, 70),
                               rtol=1e-5, atol=1e-5)


def test_without_the_cpu_kernels_onednn_runs_the_packed_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("runtime.cpu_gemm.load_cpu_kernels", lambda: False)
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    layer = prepack(linear)
    assert isinstance(layer, PrepackedLinear)
    assert (layer.kernel, layer.rows) == ("onednn", ONEDNN_DECODER_ROWS)
    for rows in (1, 3, 60):  # BLAS, oneDNN, BLAS
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-5)


def test_bfloat16_panels_give_the_float32_panels_bits() -> None:
    """A weight of exact bfloat16 values (a drafter stored in bfloat16) is packed as bfloat16 by
    prepack, and its products are the same bits as on float32 panels, at any row count."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16().float())
    wide = pack_panels(linear.weight.detach())
    packed = prepack(linear)
    assert isinstance(packed, PrepackedLinear) and packed._packed.dtype == torch.bfloat16
    assert torch.equal(packed._packed.float(), wide)
    x = torch.randn(100, 96)
    for rows in (1, 3, 4, 6, 7, 100):
        want = torch.ops.eaglebatch.panel_linear(x[:rows].contiguous(), wide, linear.bias, 200)
        assert torch.equal(packed(x[:rows]), want), rows
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias),
                               rtol=1e-5, atol=1e-5)
    assert prepack(nn.Linear(96, 200))._packed.dtype == torch.float32  # type: ignore[union-attr]


def test_int8_panels_are_the_float32_chain_times_the_scale() -> None:
    """prepack(int8=True) (a drafter quantized on load): int8 values and per-output scales with
    weight ~= values * scale; each product is bitwise the float32-panel product of the int8 values
    (as floats), times the scale, plus the bias, at any row count; the layer stays batch
    invariant."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    with torch.no_grad():
        linear.weight[5] = 0.0  # an all-zero output gets scale 1, not 0 / 0
    packed = prepack(linear, int8=True)
    assert isinstance(packed, PrepackedLinear) and packed._packed.dtype == torch.int8
    assert packed._scales is not None and packed._scales.shape == (256,)
    values, scales = quantize_int8(linear.weight)
    assert values.abs().max() == 127 and scales[5] == 1.0
    assert torch.equal(values, values.round()) and torch.equal(packed._scales[:200], scales)
    assert torch.equal(packed._packed.float(), pack_panels(values))
    assert (values * scales[:, None] - linear.weight).abs().max() <= scales.max() / 2 + 1e-7
    wide = pack_panels(values)
    x = torch.randn(100, 96)
    for rows in (1, 3, 4, 6, 7, 100):
        chain = torch.ops.eaglebatch.panel_linear(x[:rows].contiguous(), wide, None, 200)
        assert torch.equal(packed(x[:rows]), chain * scales + linear.bias), rows
    assert torch.equal(packed(x[3:4]), packed(x)[3:4])
    torch.testing.assert_close(packed(x), F.linear(x, values * scales[:, None], linear.bias),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="int8 panels need scales"):
        torch.ops.eaglebatch.panel_linear(x, packed._packed, None, 200)


def test_lay_out_keeps_state_dict_and_outputs_of_a_model() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = CausalLM(config, "torch", 64).eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hidden = torch.randn(6, model.config.hidden_size)
    want_head = model.compute_logits(hidden)
    want_mlp = model.model.layers[0].mlp(hidden)
    lay_out_for_cpu(model)
    assert model.state_dict().keys() == before.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert isinstance(model.lm_head, PrepackedLinear)
    assert (model.lm_head.kernel, model.lm_head.rows) == ("panel", PANEL_ROWS)
    up_proj = model.model.layers[0].mlp.up_proj
    assert isinstance(up_proj, PrepackedLinear)
    assert (up_proj.kernel, up_proj.rows) == ("panel", PANEL_ROWS)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the tied weight keeps its rows (embedding lookups read one), untied Linears are transposed
    assert model.model.embed_tokens.weight.is_contiguous()
    assert not up_proj.weight.is_contiguous() and up_proj.weight.t().is_contiguous()
    torch.testing.assert_close(model.compute_logits(hidden), want_head, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.model.layers[0].mlp(hidden), want_mlp, rtol=1e-4, atol=1e-5)
    assert model.model.layers[0].mlp.gate_up is not None  # 64 + 64 outputs: whole panels
    assert model.model.layers[0].self_attn.qkv is None  # q has 32 outputs: not whole panels
    with torch.no_grad():  # inference takes the fused product
        torch.testing.assert_close(model.model.layers[0].mlp(hidden), want_mlp, rtol=1e-4,
                                   atol=1e-5)


def test_released_weights_leave_one_copy_and_the_same_products() -> None:
    """release_weights: every Linear whose products all run on panels drops its weight (one
    copy in memory); the tied head keeps it (the embedding reads it); the same bits out."""
    if not load_cpu_kernels():
        pytest.skip("panels need the C++ kernels")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    models = []
    for release in (False, True):
        torch.manual_seed(0)
        model = CausalLM(config, "torch", 64).eval()
        model.lm_head.weight = model.model.embed_tokens.weight
        lay_out_for_cpu(model, release_weights=release)
        models.append(model)
    kept, released = models
    linears = [m for m in released.model.modules() if isinstance(m, PrepackedLinear)]
    assert len(linears) == 2 * 7 and all(m.weight is None for m in linears)
    assert released.lm_head.weight is released.model.embed_tokens.weight
    names = set(released.state_dict())
    assert names == {n for n in kept.state_dict() if not n.endswith("proj.weight")}
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        for a, b in zip(kept.model.layers, released.model.layers, strict=True):
            assert torch.equal(a.mlp(hidden), b.mlp(hidden))
            assert torch.equal(a.self_attn.o_proj(hidden), b.self_attn.o_proj(hidden))
        assert torch.equal(kept.compute_logits(hidden), released.compute_logits(hidden))
    assert released.model.layers[0].mlp.down_proj(torch.empty(0, 128)).shape == (0, 64)


def test_an_engine_holds_one_copy_of_its_decoder_weights(tiny_model_dir: Path) -> None:
    if not load_cpu_kernels():
        pytest.skip("panels need the C++ kernels")
    engine = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20))
    linears = [m for m in engine.model.model.modules() if isinstance(m, PrepackedLinear)]
    assert linears and all(m.weight is None for m in linears)
    # the untied head too, after the exact greedy head made its copies from it
    assert isinstance(engine.model.lm_head, PrepackedLinear)
    assert engine.model.lm_head.weight is None
    assert engine.runner.exact_head is not None
    assert engine.runner.exact_head is engine.model.lm_head.exact_greedy_head


def test_prepack_leaves_unsupported_layers_alone() -> None:
    half = nn.Linear(8, 4, bias=False).to(torch.float16)
    assert prepack(half) is half
    assert prepack(nn.Identity()).__class__ is nn.Identity


@pytest.mark.parametrize("kind", ["float32", "bfloat16 panels", "int8", "bias"])
def test_fused_panels_give_each_part_its_own_bits(kind: str) -> None:
    torch.manual_seed(3)
    linears = [nn.Linear(96, out, bias=kind == "bias") for out in (128, 64, 64)]
    if kind == "bfloat16 panels":  # float32 weights holding bfloat16 values
        for linear in linears:
            linear.weight.data = linear.weight.data.bfloat16().float()
    parts = [prepack(linear, int8=kind == "int8") for linear in linears]
    x = torch.randn(37, 96)
    alone = [part(x) for part in parts]
    fused = fuse_panels(parts)
    assert fused is not None and fused.splits == [128, 64, 64]
    assert all(torch.equal(a, b) for a, b in zip(alone, fused(x), strict=True))
    for rows in (1, 3, 37):  # each part its own contiguous tensor: no copies before attention
        outputs = fused(x[:rows])
        assert [tuple(o.shape) for o in outputs] == [(rows, 128), (rows, 64), (rows, 64)]
        assert all(o.is_contiguous() for o in outputs)
        assert all(torch.equal(a[:rows], o) for a, o in zip(alone, outputs, strict=True))
    # the parts now read slices of the joined panels: no second copy, the same results
    assert all(part._packed.data_ptr() >= fused._packed.data_ptr() for part in parts)
    assert all(torch.equal(a, part(x)) for a, part in zip(alone, parts, strict=True))


def test_panels_that_cannot_share_a_call_are_not_fused() -> None:
    torch.manual_seed(4)
    whole, ragged = prepack(nn.Linear(96, 64)), prepack(nn.Linear(96, 100))  # 100: not whole panels
    assert fuse_panels([whole, ragged]) is None
    assert fuse_panels([whole, prepack(nn.Linear(96, 64, bias=False))]) is None  # bias mismatch
    assert fuse_panels([whole, nn.Linear(96, 64)]) is None  # not packed
