"""CPU weight layouts: values and parameter identity unchanged, products equal F.linear on both
kernels (BLAS below/above the packed row range, oneDNN inside it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from runtime.cpu_gemm import (
    DECODER_PACKED_ROWS,
    PrepackedLinear,
    lay_out_for_cpu,
    prepack,
    transpose_linear_weights,
)
from runtime.model import CausalLM


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
    packed = prepack(head)
    x = torch.randn(7, 32)
    if isinstance(packed, PrepackedLinear):  # oneDNN present (x86 CPU builds of torch)
        assert packed.weight is embed.weight
        assert packed.out_features == 1000
    torch.testing.assert_close(packed(x), F.linear(x, embed.weight), rtol=1e-4, atol=1e-4)
    assert packed(x[:0]).shape == (0, 1000)


@pytest.mark.parametrize("rows", [1, 2, 5, DECODER_PACKED_ROWS[1], DECODER_PACKED_ROWS[1] + 1])
def test_packed_decoder_linear_with_bias_matches_on_both_sides_of_the_range(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    want_layer = nn.Linear(24, 40)
    want_layer.load_state_dict(linear.state_dict())
    layer = prepack(linear, DECODER_PACKED_ROWS)
    if isinstance(layer, PrepackedLinear):
        assert layer.bias is linear.bias and layer.weight is linear.weight
    x = torch.randn(rows, 24)
    torch.testing.assert_close(layer(x), want_layer(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 24)), want_layer(x).view(1, rows, 40),
                               rtol=1e-5, atol=1e-5)


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
    if isinstance(model.lm_head, PrepackedLinear):
        assert model.lm_head.rows == (2, None)
        assert model.model.layers[0].mlp.up_proj.rows == DECODER_PACKED_ROWS  # type: ignore[union-attr]
        assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.compute_logits(hidden), want_head, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.model.layers[0].mlp(hidden), want_mlp, rtol=1e-4, atol=1e-5)


def test_prepack_leaves_unsupported_layers_alone() -> None:
    half = nn.Linear(8, 4, bias=False).to(torch.float16)
    assert prepack(half) is half
    assert prepack(nn.Identity()).__class__ is nn.Identity
