"""CPU weight layouts: values and parameter identity unchanged, products equal F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cpu_gemm import PrepackedLinear, prepack_head, transpose_linear_weights


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
    packed = prepack_head(head)
    x = torch.randn(7, 32)
    if isinstance(packed, PrepackedLinear):  # oneDNN present (x86 CPU builds of torch)
        assert packed.weight is embed.weight
        assert packed.out_features == 1000
    torch.testing.assert_close(packed(x), F.linear(x, embed.weight), rtol=1e-4, atol=1e-4)
    assert packed(x[:0]).shape == (0, 1000)


def test_prepack_leaves_unsupported_heads_alone() -> None:
    with_bias = nn.Linear(8, 4)
    assert prepack_head(with_bias) is with_bias
    half = nn.Linear(8, 4, bias=False).to(torch.float16)
    assert prepack_head(half) is half
    assert prepack_head(nn.Identity()).__class__ is nn.Identity
