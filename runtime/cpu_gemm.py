"""How Linear products run on the CPU (values never change beyond rounding, only layout and kernel).

Every Linear (but an LM head tied to the embedding, whose lookups read rows) keeps its [out, in]
weight as the transposed view of a contiguous [in, out] tensor, so BLAS skips a transpose, and
gets one packed copy that runs its products (or those of a range of row counts, i.e. tokens).
Measured on the default model's shapes (fp32, one thread, a 2-core Xeon with AVX-512; all 30
decoder layers with their own weights, so that they stream from memory as in a real step; ms):

    rows                  1     2     3     4     8     16    32    48    64
    BLAS, transposed      34.7  52.0  55.2  60.8  70.6  86.8  100   112   113
    oneDNN, prepacked     44.6  45.8  45.7  47.3  55.0  66.9  90.7  112   134
    panel_linear          36.5  36.1  36.8  37.5  45.5  56.6  81.4  103   125
    LM head:
    BLAS, transposed      8.1   12.8  14.2  15.1  20.0  23.3  29.7  33.8  40.3
    oneDNN, prepacked     9.5   10.3  11.0  10.0  11.8  14.4  22.0  27.8  34.4
    panel_linear          8.2   8.7   8.9   9.2   10.9  13.9  19.7  25.1  30.0

- panel_linear (runtime/csrc/linear.cpp) for every float32 product. It is the fastest up to 48
  rows (decode and draft verification at small batches) and within 10% of BLAS above, and a row's
  result from it does not depend on the other rows. With the cpu attention backend, which has the
  same property, a request's logits after the same prefill are the same bits whether it decodes
  alone, verifies k drafts, or runs next to 63 other requests: greedy speculative decoding is
  exactly lossless. (Decode at batch 64 costs about 8% more than with BLAS; exactness is worth it.)
- Float32 weights that allow it get bfloat16, int8 (a drafter only) or 4-bit panels besides
  (runtime.weight_panels has the formats and figures); bfloat16 and 4-bit panels give the
  same bits, int8 panels change drafts only.
- In bfloat16: oneDNN on a prepacked copy for every product (with AMX, 30 layers of the default
  model at 64 rows: 16 ms against 26 with F.linear; 7.5 against 17 at one row). Without the C++
  kernels in float32: oneDNN for 2..48 decoder rows and from 2 head rows, BLAS otherwise.
  Rounding then depends on the row count.
The packed copy would double the memory of the weights (424 MB for the default model's decoder,
113 MB for its head; panels pad the outputs to a multiple of 64). An engine's models let go of
the original weight of every Linear whose products all run on its packed copy
(lay_out_for_cpu(release_weights=True)), each right after packing it: one copy of the decoder
stays (default model and drafter after the build 1867 -> 1162 MiB resident; a random
Llama-3-8B in bfloat16 now fits a 24 GiB machine). The head keeps its weight here; an untied
one lets go of it once the exact greedy head has made its copies (runtime.setup), a tied one's
is the embedding's. Without release_weights the
original Parameters stay, so tying and state_dict are unchanged. Where packing is not possible
or disagrees with F.linear on a probe, the Linear stays plain. The packed copies then move into
transparent huge pages (runtime.huge_pages: a step streams them with fewer TLB misses; batch 1,
AMD EPYC: the plain step +11-14%).
"""

from __future__ import annotations

from typing import TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cpu_kernels import load_cpu_kernels
from runtime.host_memory import return_freed_memory
from runtime.huge_pages import keep_in_huge_pages
from runtime.weight_panels import (
    PANEL,
    exactly_bfloat16,
    int8_panels,
    pack_panels,
    q4_panels,
    quantize_int8,
)

PANEL_ROWS = (1, None)  # every product
ONEDNN_DECODER_ROWS = (2, 48)  # without the C++ kernels
ONEDNN_HEAD_ROWS = (2, None)
ONEDNN_BF16_ROWS = (1, None)
Q4_ROWS = 12  # 4-bit panels run products of 1..Q4_ROWS rows (two register tiles)
_PROBE_ROWS = 4


def lay_out_for_cpu(module: nn.Module, int8: bool = False, q4: bool = False,
                    release_weights: bool = False) -> None:
    """Transposed storage for every Linear under `module` and a packed copy for each; call once
    after the weights are loaded and cast. `module.lm_head`, if any, is packed as the head.
    int8: float32 weights get int8 panels (their products change: only for a drafter).
    q4: weights that are exactly Q4_1 values also get 4-bit panels (the same products).
    release_weights: a Linear whose products of every row count run on its packed copy lets go
    of its original weight, each right after packing (PrepackedLinear.release_weight): the
    engine holds one copy of those weights, not two (inference only: they leave state_dict).
    Not the head, and not a weight tied to an embedding.
    Then every submodule with a `fuse_for_cpu` method (attention's q/k/v, the MLP's gate/up)
    gets to join its products on one input into one call (FusedPanels), and every one with a
    `plan_for_cpu` method (a decoder layer) gets its kernels as one flat call
    (runtime.cpu_layer), and every one with a `stack_for_cpu` method (a model, a drafter) its
    planned layers as one C++ call."""
    transpose_linear_weights(module)
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for parent in list(module.modules()):
        released = False
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                is_head = parent is module and name == "lm_head"
                packed = prepack(child, head=is_head, int8=int8, q4=q4)
                setattr(parent, name, packed)
                if (release_weights and not is_head and id(child.weight) not in embedded
                        and isinstance(packed, PrepackedLinear)):
                    packed.release_weight()
                    if packed.weight is None:  # the replaced Linear (still listed) lets go too
                        child.weight = None  # type: ignore[assignment]
                        released = True
        if released:
            return_freed_memory()  # glibc's heap would keep it until the end
    for sub in list(module.modules()):
        fuse = getattr(sub, "fuse_for_cpu", None)
        if callable(fuse):
            fuse()
            return_freed_memory()  # the parts' own panels were just freed
    keep_in_huge_pages(packed_tensors(module))  # runtime.huge_pages: fewer TLB misses
    for sub in list(module.modules()):  # then layers whose products are all panels: one plan
        plan = getattr(sub, "plan_for_cpu", None)
        if callable(plan):
            plan()
    for sub in list(module.modules()):
        stack = getattr(sub, "stack_for_cpu", None)
        if callable(stack):
            stack()


def q4_weight_count(module: nn.Module) -> tuple[int, int]:
    """(weight matrices under `module` with 4-bit panels, weight matrices on panels)."""
    packed = [m for m in module.modules() if isinstance(m, PrepackedLinear)]
    return sum(m.q4_exact for m in packed), len(packed)


def packed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The packed copies under `module` (panels, their scales and 4-bit parts) of every
    PrepackedLinear and FusedPanels, fused parts' views included."""
    tensors: list[torch.Tensor] = []
    for sub in module.modules():
        holders: list[PrepackedLinear | FusedPanels] = [
            v for v in vars(sub).values() if isinstance(v, FusedPanels)]
        if isinstance(sub, PrepackedLinear):
            holders.append(sub)
        for h in holders:
            tensors += [h._packed, *(() if h._scales is None else (h._scales,)), *(h._q4 or ())]
    return tensors


class FusedPanels:
    """Products of several panel Linears on the same input in one panel_linear call: their panels
    side by side in one tensor, whose slices become the parts' own panels (no extra memory).
    Every output column comes from the same chain as in its own product: the same bits, with one
    call (and one split of the work among threads) instead of several. Each part's output is its
    own contiguous tensor (at several rows, slices of one [rows, sum] product were not: q/k/v
    copies, silu and mul on strided views). Not an nn.Module: it holds no parameters, and
    state_dict keeps the parts' names."""

    def __init__(self, parts: list[PrepackedLinear]) -> None:
        self.in_features = parts[0].in_features
        self.splits = [p.out_features for p in parts]
        self.out_features = sum(self.splits)
        self._packed = torch.cat([p._packed for p in parts])
        offset = 0
        for p in parts:  # the parts read their slice of the joined panels from now on
            count = p._packed.shape[0]
            p._packed = self._packed[offset:offset + count]
            offset += count
        biases = [p.bias for p in parts]
        self.bias = (None if biases[0] is None else
                     torch.cat([b.detach() for b in biases if b is not None]))
        scales = [p._scales for p in parts]
        self._scales = (None if scales[0] is None else
                        torch.cat([s for s in scales if s is not None]))
        q4 = [p._q4 for p in parts]
        self._q4 = (None if any(t is None for t in q4) else
                    (torch.cat([t[0] for t in q4 if t is not None]),
                     torch.cat([t[1] for t in q4 if t is not None])))
        for p in parts:
            p._q4 = None  # the joined copy serves them (a part alone never runs after fusing)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.numel() // self.in_features
        flat = x.reshape(n, self.in_features).contiguous()
        if self._q4 is not None and n <= Q4_ROWS:
            return tuple(torch.ops.eaglebatch.panel_linear_parts_q4(flat, *self._q4, self.bias,
                                                                   self.splits))
        return tuple(torch.ops.eaglebatch.panel_linear_parts(flat, self._packed, self.bias,
                                                            self.splits, self._scales))


def fuse_panels(parts: list[nn.Module]) -> FusedPanels | None:
    """FusedPanels of `parts` when they can share a call: all panel products of every row count
    on the same input width, outputs in whole panels, the same panel dtype, all with or all
    without bias and scales; else None."""
    if not all(runs_on_panels(p) and p.out_features % PANEL == 0 for p in parts):
        return None
    linears = [p for p in parts if isinstance(p, PrepackedLinear)]
    first = linears[0]
    if any(p.in_features != first.in_features or p._packed.dtype != first._packed.dtype
           or (p.bias is None) != (first.bias is None)
           or (p._scales is None) != (first._scales is None) for p in linears):
        return None
    return FusedPanels(linears)


def runs_on_panels(module: nn.Module) -> TypeGuard[PrepackedLinear]:
    """A PrepackedLinear whose products of every row count run on panel_linear."""
    return (isinstance(module, PrepackedLinear) and module.kernel == "panel"
            and module.rows == PANEL_ROWS)


def transpose_linear_weights(module: nn.Module) -> None:
    """Stores every Linear weight under `module` as the transposed view of an [in, out] tensor,
    except one tied to an Embedding (a tied LM head): its products run on the packed copy, and
    the embedding's lookups want rows (from the transposed storage one token's row is a strided
    column, a cache line and often a page per value: ~0.2-0.5 ms a lookup)."""
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for layer in module.modules():
        if (isinstance(layer, nn.Linear) and layer.weight.is_contiguous()
                and id(layer.weight) not in embedded):
            layer.weight.data = layer.weight.data.t().contiguous().t()


class PrepackedLinear(nn.Module):
    """A Linear that runs products of `rows` (min, max or None) rows on a packed copy of its
    weight: panels for panel_linear (`kernel` "panel") or a oneDNN packing ("onednn"), and the
    rest on `weight` itself (F.linear). `weight` and `bias` are the original Parameters;
    `weight` is None once released (release_weight)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, kernel: str,
                 rows: tuple[int, int | None], scales: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = cast(nn.Parameter, linear.weight)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.rows = rows
        self.exact_greedy_head: object | None = None  # a head's, built once (runtime.greedy_head)
        self._packed = packed
        self._scales = scales  # int8 panels: [panels * 64] float32 per output column
        # (nibbles, d and m) of 4-bit panels that give the same bits (q4_panels), or None
        self._q4: tuple[torch.Tensor, torch.Tensor] | None = None
        self.q4_exact = False  # got 4-bit panels (kept when fusing moves them to FusedPanels)

    @property
    def covers_all_rows(self) -> bool:
        """Whether products of every row count run on the packed copy (never on `weight`)."""
        return self.rows[0] <= 1 and self.rows[1] is None

    def release_weight(self) -> None:
        """Drops the original weight where the packed copy serves every product (no-op
        elsewhere): the module keeps computing the same values, from one copy. For inference
        only: the weight leaves parameters() and state_dict()."""
        if self.covers_all_rows:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if n == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        low, high = self.rows
        if n < low or (high is not None and n > high):
            assert self.weight is not None  # kept: rows outside the packed copy's range
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(n, self.in_features).contiguous()
        if self._q4 is not None and n <= Q4_ROWS:
            out = torch.ops.eaglebatch.panel_linear_q4(flat, *self._q4, self.bias,
                                                       self.out_features)
        elif self.kernel == "panel":
            out = torch.ops.eaglebatch.panel_linear(flat, self._packed, self.bias,
                                                    self.out_features, self._scales)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def prepack(linear: nn.Module, head: bool = False, int8: bool = False,
            q4: bool = False) -> nn.Module:
    """`linear` with its packed copy (panels for float32 when the C++ kernels load, else oneDNN),
    when packing works here and agrees with F.linear on a probe; else `linear` itself.
    int8: int8 panels for a float32 weight (see the module docstring); no effect elsewhere.
    q4: also 4-bit panels for a float32 weight that allows them exactly (q4_panels), not for
    a head."""
    if not isinstance(linear, nn.Linear):
        return linear
    weight = linear.weight.detach()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return linear
    if weight.dtype == torch.float32 and load_cpu_kernels():
        if int8:
            quantized, scales = quantize_int8(weight)
            panels, padded = int8_panels(quantized, scales)
            return _checked(linear, panels, "panel", PANEL_ROWS, scales=padded,
                            reference=quantized * scales.unsqueeze(1))
        exact16 = exactly_bfloat16(weight)  # then no bits are lost: half the bytes
        panels = pack_panels(weight.bfloat16() if exact16 else weight)
        packed = _checked(linear, panels, "panel", PANEL_ROWS)
        if q4 and isinstance(packed, PrepackedLinear) and not head:
            packed._q4 = q4_panels(weight)
            packed.q4_exact = packed._q4 is not None
        return packed
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (RuntimeError, AttributeError):
        return linear
    if weight.dtype == torch.bfloat16:  # prepacked wins at every row count in bfloat16
        return _checked(linear, packed, "onednn", ONEDNN_BF16_ROWS)
    return _checked(linear, packed, "onednn", ONEDNN_HEAD_ROWS if head else ONEDNN_DECODER_ROWS)


def _checked(linear: nn.Linear, packed: torch.Tensor, kernel: str,
             rows: tuple[int, int | None], scales: torch.Tensor | None = None,
             reference: torch.Tensor | None = None) -> nn.Module:
    """The packed layer if it agrees on a probe with F.linear on `reference` (the weight the
    packed copy stands for: `linear.weight`, or its int8 values times their scales)."""
    weight = linear.weight.detach() if reference is None else reference
    layer = PrepackedLinear(linear, packed, kernel, (1, None), scales)  # probe the packed path
    probe = torch.randn(_PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)
                        ).to(weight.dtype)
    try:
        got, want = layer(probe).float(), F.linear(probe, weight, linear.bias).float()
    except (RuntimeError, AttributeError):
        return linear
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if got.shape != want.shape or (got - want).abs().max() > tolerance * want.abs().max():
        return linear
    layer.rows = rows
    return layer


