"""The greedy token without the full float32 LM head: a bfloat16 product picks the candidates,
panel_entries computes them exactly. Same answer, bit for bit, as argmax of the full head.

A greedy step needs argmax_v z_v of the float32 logits z = h W^T (on the CPU: panel_linear, one
FMA chain per entry), not the logits. A bfloat16 product a = bf16(h) bf16(W)^T (oneDNN, AMX on
CPUs that have it: about a third of the float32 head's time at 64 rows; used from ONEDNN_ROWS
rows) is close to z with a proven bound per entry:

    |a_v - z_v| <= B_v = C1 * |h| * |w_v| + C2 * |a_v|      (|.|: Euclidean norms)

(rounding h and w_v to bfloat16 moves each product by at most 2^-9 of its size, twice: 2^-8 in
all by Cauchy-Schwarz; summing 576 float32 terms in any order, and the float32 chain itself,
each err by under 2^-14 of sum |h_i w_vi|; rounding a to bfloat16 at the end by 2^-9 |a_v|;
C1 and C2 round these up). So the winner is among the candidates {v : a_v + B_v >= max_u (a_u -
B_u)}; on the default model a median of 1 and at most about a dozen per row. Their exact logits
come from panel_entries (the same chains as panel_linear: the same bits), and the first index of
their maximum is the answer argmax_rows would give on the full logits. Rows whose logits are not
all finite take the full head instead (NaN and infinities keep argmax_rows' rules).

Below ONEDNN_ROWS rows (decode and draft verification at small batches), a = bf16(h bf16(W)^T)
comes from panel_linear on bfloat16 panels instead: float32 h, each weight widened exactly, so
its error is within the bound above (h is not rounded at all). It reads half the float32 head's
bytes, which is what a product of a few rows costs (AMD EPYC, 2 threads, 49k x 576 head: 1 / 3
rows 2.4 / 2.5 ms against 4.6 / 4.3 for the float32 head and 3.6 / 3.6 for oneDNN's bfloat16).

EAGLEBATCH_EXACT_HEAD=0 turns it off.
"""

from __future__ import annotations

import os

import torch

from runtime.cpu_gemm import PrepackedLinear
from runtime.cpu_kernels import argmax_rows, load_cpu_kernels

C1 = 2.0**-8 + 2.0**-12  # bfloat16 inputs (2^-8 + 2^-18) + sums in float32 (2 * 2^-14.8)
C2 = 2.0**-8  # the product's bfloat16 output, rounded from float32 (2^-9, doubled)
SLACK = 1e-30  # keeps B > 0 where norms underflow
# From this many rows the candidates come from oneDNN's bfloat16 product (AMX where the CPU has
# it), below from bfloat16 panels (2 threads, EPYC: 8 rows 3.4 / 3.0 ms, 16 rows 4.6 / 5.4)
ONEDNN_ROWS = 8


class ExactGreedyHead:
    """argmax(head(hidden)) for float32 rows, from two bfloat16 copies of the head's weight
    (oneDNN's packing and panels, each half the float32 head's memory) and the head's panels."""

    def __init__(self, head: PrepackedLinear) -> None:
        weight = head.weight.detach()
        self.head = head
        self.panels_bf16 = head._packed.bfloat16()  # rounds each weight to nearest: 2^-9
        # oneDNN's own packing of the bfloat16 copy: 1.4 / 2.5 ms at 8 / 64 rows against 3.0 /
        # 4.4 for a plain [hidden, vocab] matmul (2 threads, default model); the bound holds for
        # any summation order. The plain layout where this torch cannot pack.
        bf16 = weight.bfloat16().contiguous()
        try:
            self._packed_bf16: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(
                bf16, None)
        except (RuntimeError, AttributeError):
            self._packed_bf16 = None
        self.weight_bf16_t = bf16.t().contiguous() if self._packed_bf16 is None else None
        self.weight_norms = weight.float().norm(dim=1) * (1 + 2.0**-10)  # [vocab], rounded up

    @classmethod
    def for_head(cls, head: torch.nn.Module) -> ExactGreedyHead | None:
        """The exact greedy head for a float32 CPU head on panels without a bias, else None.
        Engines sharing one target model share its exact head (and its bfloat16 copies)."""
        if (os.environ.get("EAGLEBATCH_EXACT_HEAD", "1") == "0"
                or not isinstance(head, PrepackedLinear) or head.kernel != "panel"
                or head.bias is not None
                or head._scales is not None or head.weight.dtype != torch.float32
                or head.weight.device.type != "cpu" or not load_cpu_kernels()):
            return None
        built = head.exact_greedy_head
        if not isinstance(built, cls):
            built = cls(head)
            head.exact_greedy_head = built  # a cycle through the head: freed with it by gc
        return built

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows] int64
        hidden = hidden.float().contiguous()
        approx = self._approx(hidden)  # [rows, vocab] bfloat16
        rows, cols, finite = torch.ops.eaglebatch.head_candidates(
            approx, hidden.norm(dim=1), self.weight_norms, C1, C2, SLACK)
        if not finite:
            return self._full(hidden)
        exact = torch.ops.eaglebatch.panel_entries(hidden, self.head._packed, self.head.bias,
                                                   self.head.out_features, rows, cols)
        if not bool(exact.isfinite().all()):
            return self._full(hidden)
        n = hidden.shape[0]
        peak = torch.full((n,), -torch.inf).scatter_reduce(0, rows, exact, "amax")
        top = exact == peak[rows]  # ties: the first (smallest) column, as argmax_rows
        first = torch.full((n,), approx.shape[1], dtype=torch.int64)
        return first.scatter_reduce(0, rows[top], cols[top], "amin")

    def _approx(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] < ONEDNN_ROWS:
            return torch.ops.eaglebatch.panel_linear(hidden, self.panels_bf16, None,
                                                     self.head.out_features).bfloat16()
        if self._packed_bf16 is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.bfloat16(), self._packed_bf16, None,
                                                      "none", [], "")
        assert self.weight_bf16_t is not None
        return hidden.bfloat16() @ self.weight_bf16_t

    def _full(self, hidden: torch.Tensor) -> torch.Tensor:
        """The plain way: the whole float32 head, then its argmax."""
        return argmax_rows(self.head(hidden))
