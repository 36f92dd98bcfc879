"""How Linear products run on the CPU (values never change beyond rounding, only layout and kernel).

Every Linear keeps its [out, in] weight as the transposed view of a contiguous [in, out] tensor,
so BLAS skips a transpose, and also gets a oneDNN-prepacked copy; each product picks the kernel by
its number of rows (tokens), from measurements on the default model (fp32, one thread, a 2-core
Xeon with AVX-512; decoder products of all 30 layers, ms):

    rows                      1     3     4     16    48    64
    BLAS, transposed layout   31.2  50.5  54.6  79.5  91.8  92.6
    oneDNN, prepacked         41.3  45.3  42.3  58.5  92.0  111.5

- Decoder layers: oneDNN for 2..48 rows (decode at batch 2..48, and verification of k drafts
  for up to 48 / (k + 1) sequences), BLAS otherwise (single-row decode is a matrix-vector
  product; large batches and prefill chunks).
- The LM head (vocabulary-sized, 113 MB for the default model): oneDNN from 2 rows (14 instead of
  25 ms at 16 rows, 31 instead of 42 at 64), BLAS for one row.
The packed copy doubles the memory of the weights (424 MB more for the default model's decoder,
113 MB for its head); the original Parameters stay, so tying and state_dict names are unchanged.
Where the packing op is missing or disagrees with F.linear on a probe, the Linear stays plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DECODER_PACKED_ROWS = (2, 48)
HEAD_PACKED_ROWS = (2, None)
_PROBE_ROWS = 4


def lay_out_for_cpu(module: nn.Module) -> None:
    """Transposed storage for every Linear under `module` and a packed copy for each; call once
    after the weights are loaded and cast. `module.lm_head`, if any, gets the head's row range."""
    transpose_linear_weights(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                is_head = parent is module and name == "lm_head"
                setattr(parent, name, prepack(child, HEAD_PACKED_ROWS if is_head
                                              else DECODER_PACKED_ROWS))


def transpose_linear_weights(module: nn.Module) -> None:
    """Stores every Linear weight under `module` as the transposed view of an [in, out] tensor."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.t().contiguous().t()


class PrepackedLinear(nn.Module):
    """A Linear that runs on a oneDNN-prepacked copy of its weight for products of `rows`
    (min, max or None) rows, and on `weight` itself (F.linear) otherwise. `weight` and `bias` are
    the original Parameters (same objects)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor,
                 rows: tuple[int, int | None]) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows = rows
        self._packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        low, high = self.rows
        if n < low or (high is not None and n > high):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(n, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def prepack(linear: nn.Module, rows: tuple[int, int | None] = HEAD_PACKED_ROWS) -> nn.Module:
    """`linear` with a oneDNN-packed copy for `rows`-row products, when packing works here and
    agrees with F.linear; else `linear` itself."""
    if not isinstance(linear, nn.Linear):
        return linear
    weight = linear.weight.detach()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return linear
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        layer = PrepackedLinear(linear, packed, (1, None))  # probe the packed path itself
        probe = torch.randn(_PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)
                            ).to(weight.dtype)
        got, want = layer(probe).float(), F.linear(probe, weight, linear.bias).float()
    except (RuntimeError, AttributeError):
        return linear
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if got.shape != want.shape or (got - want).abs().max() > tolerance * want.abs().max():
        return linear
    layer.rows = rows
    return layer
