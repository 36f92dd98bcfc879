"""The greedy token without the full float32 LM head: a bfloat16 product (below 8 rows an int8
copy: panels, or integer products with VNNI, up to 48 rows without AMX) picks the candidates,
panel_entries computes them exactly. Same answer, bit for bit, as argmax of the full head.

A greedy step needs argmax_v z_v of the float32 logits z = h W^T (on the CPU: panel_linear, one
FMA chain per entry), not the logits. A bfloat16 product a = bf16(h) bf16(W)^T (oneDNN, AMX on
CPUs that have it: about a third of the float32 head's time at 64 rows; used from ONEDNN_ROWS
rows) is close to z with a proven bound per entry:

    |a_v - z_v| <= B_v = C1 * |h| * |w_v| + C2 * |a_v|      (|.|: Euclidean norms)

(rounding h and w_v to bfloat16 moves each product by at most 2^-9 of its size, twice: 2^-8 +
2^-18 in all by Cauchy-Schwarz; summing the n = hidden-size float32 terms in any order, and the
float32 chain itself, each err by under chain_error(n) of sum |h_i w_vi| (2^-14.8 for the
default model's 576); rounding a to bfloat16 at the end by 2^-9 |a_v|; C1, per head, and C2
round these up). So the winner is among the candidates {v : a_v + B_v >= max_u (a_u -
B_u)}; on the default model a median of 1 and at most about a dozen per row. Their exact logits
come from panel_entries (the same chains as panel_linear: the same bits), and the first index of
their maximum is the answer argmax_rows would give on the full logits. Rows whose logits are not
all finite take the full head instead (NaN and infinities keep argmax_rows' rules).

Below ONEDNN_ROWS rows (decode and draft verification at small batches; below DOTS_ROWS with
integer products on a CPU without AMX), a comes from panel_linear on int8 panels instead (w_v ~
s_v q_v, one scale per output, as a drafter's int8 weights): a quarter of the float32 head's
bytes, which is what a product of a few rows costs. Its own bound, per entry:

    |a_v - z_v| <= |h| * F_v + C2 * |a_v|,   F_v = |w_v - s_v q_v| + c (|w_v| + |s_v q_v|)

(h is not rounded; the int8 weights are off by e_v = w_v - s_v q_v, so the exact products differ
by at most |h| |e_v|; each float32 chain, the kernel's over h and q_v and the head's over h and
w_v, errs by under c = chain_error(n) of its sum of |terms|, at most |h| |s_v q_v| and |h| |w_v|;
scaling by s_v and rounding to bfloat16 at the end, by under 2^-9 |a_v|). F_v is computed once in
float64 and rounded up. On the default model a median of 2 and at most about 30 candidates per
row (1 and 11 with bfloat16 panels). The head of real decode rows, caches flushed (AMD EPYC, 2
threads, 49k x 576): 1 / 3 / 6 rows 1.46 / 1.61 / 2.26 ms against 2.18 / 2.20 / 2.63 from
bfloat16 panels.

On CPUs with AVX-512 VNNI the rows are rounded to 16-bit integers too (h ~ s_h p, one scale per
row) and the products summed exactly in integers (head_int8_dots: two instructions per 64
weights and row, where the float32 products of int8 panels spend four FMAs per row and eight
instructions widening the weights, so that at 3-7 rows it is bound by reading the weights: the
whole head of real rows, 1 / 3 / 4 / 6 / 7 rows, 1.02 / 1.36 / 1.78 / 2.21 / 3.02 -> 1.03 /
1.17 / 1.61 / 1.82 / 2.25 ms, EPYC, 2 threads, caches flushed).
Rounding h moves the exact product by at most |h - s_h p| |s_v q_v|, so the bound gains a term:

    |a_v - z_v| <= |h| * F_v + |h - s_h p| * N_v + C2 * |a_v|,   N_v = |s_v q_v|

(the integer sums are exact; converting and scaling them rounds by under 3 * 2^-24 of |a_v|,
inside C2's room; the kernel returns |h - s_h p| rounded up, N_v is rounded up here; F_v's part
for the kernel's float32 chain is not needed then, and only widens the bound).

EAGLEBATCH_EXACT_HEAD=0 turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from runtime.cpu_gemm import PrepackedLinear
from runtime.cpu_kernels import argmax_rows, load_cpu_kernels
from runtime.huge_pages import keep_in_huge_pages
from runtime.weight_panels import PANEL, int8_panels, quantize_int8

C2 = 2.0**-8  # the product's bfloat16 output, rounded from float32 (2^-9, doubled)
SLACK = 1e-30  # keeps B > 0 where norms underflow
# From this many rows the candidates come from oneDNN's bfloat16 product (AMX where the CPU has
# it), below from int8 panels (2 threads, EPYC, against bfloat16 panels then: 8 rows 3.4 / 3.0
# ms, 16 rows 4.6 / 5.4)
ONEDNN_ROWS = 8
# With integer products (VNNI) and no AMX they stay the faster way up to this many rows (the whole
# head of real rows, EPYC, 2 threads, caches flushed: 8 / 16 / 32 / 48 / 64 rows 1.94 / 3.18 /
# 6.09 / 8.80 / 11.36 ms against 2.53 / 3.55 / 6.14 / 9.26 / 10.79 from oneDNN's bfloat16 product)
DOTS_ROWS = 48
# Without bfloat16 instructions (AVX2) the int8 candidates cost as many multiply-adds as the
# float32 head, plus the candidates': from this many rows the whole head is the faster way (the
# default model's head, 2 threads: 16 / 32 / 64 rows 8.4 / 16.4 / 31.4 ms against 9.7 / 13.9 /
# 26.4 for the whole head and its argmax)
FULL_HEAD_ROWS = 32
DOTS_MAX_INPUTS = 65536  # head_int8_dots' integer sums are exact up to this hidden size


def _bf16_instructions() -> bool:
    """Whether oneDNN runs bfloat16 products with vector instructions on this CPU (AVX-512 or
    AMX; not AVX2, nor a torch built without oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class ExactGreedyHead:
    """argmax(head(hidden)) for float32 rows, from a bfloat16 copy of the head's weight in
    oneDNN's packing (half the float32 head's memory), an int8 copy (a quarter: in panels, or
    for integer products with VNNI) and the head's own panels."""

    def __init__(self, head: PrepackedLinear) -> None:
        assert head.weight is not None, "the head keeps its weight (lay_out_for_cpu)"
        weight = head.weight.detach()
        self.head = head
        chain = chain_error(weight.shape[1])
        # bfloat16 inputs (2^-8 + 2^-18), then the product's and the head's float32 sums
        self.c1 = 2.0**-8 + 2.0**-18 + 2 * chain * (1 + 2.0**-8)
        values, scales, self.int8_factors, self.int8_norms = _int8_copy(weight, chain)
        self.panels_int8: torch.Tensor | None = None
        self.dots: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed, column sums)
        if torch.ops.eaglebatch.head_int8_dots_native() and weight.shape[1] <= DOTS_MAX_INPUTS:
            self.dots = pack_int8_dots(values)
            self.scales = F.pad(scales, (0, -len(scales) % PANEL))
        else:
            self.panels_int8, self.scales = int8_panels(values, scales)
        del values
        # below how many rows the int8 copy picks the candidates (AMX: oneDNN from ONEDNN_ROWS)
        self._dots_wide = self.dots is not None and not torch.cpu._is_amx_tile_supported()
        # oneDNN's own packing of the bfloat16 copy: 1.4 / 2.5 ms at 8 / 64 rows against 3.0 /
        # 4.4 for a plain [hidden, vocab] matmul (2 threads, default model); the bound holds for
        # any summation order. The plain layout where this torch cannot pack.
        # A CPU without bfloat16 instructions (AVX2) has neither: torch's bfloat16 matmul there
        # is a scalar loop (a batch-16 job ran at 8 tokens/s), so its int8 copy picks the
        # candidates at every row count.
        self._int8_only = not _bf16_instructions()
        self._packed_bf16: torch.Tensor | None = None
        self.weight_bf16_t: torch.Tensor | None = None
        if not self._int8_only:  # (no bfloat16 copy at all there)
            bf16 = weight.bfloat16().contiguous()
            try:
                self._packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(bf16, None)
            except (RuntimeError, AttributeError):
                self.weight_bf16_t = bf16.t().contiguous()
        self.weight_norms = weight.float().norm(dim=1) * (1 + 2.0**-10)  # [vocab], rounded up
        # what small steps read every time: in huge pages, as the head's panels
        keep_in_huge_pages([*(self.dots or ()), self.panels_int8, self.scales, self.int8_factors,
                            self.int8_norms, self.weight_norms, self.weight_bf16_t])

    @classmethod
    def for_head(cls, head: torch.nn.Module) -> ExactGreedyHead | None:
        """The exact greedy head for a float32 CPU head on panels without a bias, else None.
        Engines sharing one target model share its exact head (and its bfloat16 copies)."""
        if os.environ.get("EAGLEBATCH_EXACT_HEAD", "1") == "0":
            return None
        if isinstance(head, PrepackedLinear) and isinstance(head.exact_greedy_head, cls):
            return head.exact_greedy_head  # built before its head let go of its weight
        if (not isinstance(head, PrepackedLinear) or head.kernel != "panel"
                or head.bias is not None
                or head._scales is not None or head.weight is None
                or head.weight.dtype != torch.float32
                or head.weight.device.type != "cpu" or not load_cpu_kernels()):
            return None
        built = cls(head)
        head.exact_greedy_head = built  # a cycle through the head: freed with it by gc
        return built

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows] int64
        hidden = hidden.float().contiguous()
        if self._int8_only and hidden.shape[0] >= FULL_HEAD_ROWS:
            return self._full(hidden)
        small = hidden.shape[0] < self._int8_rows()
        approx, residual = self._approx(hidden)  # [rows, vocab] bfloat16, [rows] or None
        factors, c1 = (self.int8_factors, 1.0) if small else (self.weight_norms, self.c1)
        rows, cols, finite = torch.ops.eaglebatch.head_candidates(
            approx, hidden.norm(dim=1), factors, c1, C2, SLACK, residual,
            None if residual is None else self.int8_norms)
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

    def _approx(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The approximate logits (bfloat16) and, where the rows were rounded to integers
        (integer products), each row's |h - s_h p| for the bound (else None)."""
        n = self.head.out_features
        if hidden.shape[0] >= self._int8_rows():
            if self._packed_bf16 is not None:
                return torch.ops.mkldnn._linear_pointwise(hidden.bfloat16(), self._packed_bf16,
                                                          None, "none", [], ""), None
            assert self.weight_bf16_t is not None
            return hidden.bfloat16() @ self.weight_bf16_t, None
        if self.dots is not None:
            approx, residual = torch.ops.eaglebatch.head_int8_dots(hidden, *self.dots,
                                                                   self.scales, n)
            return approx.bfloat16(), residual
        return torch.ops.eaglebatch.panel_linear(hidden, self.panels_int8, None, n,
                                                 self.scales).bfloat16(), None

    def _int8_rows(self) -> int:
        """Products of fewer rows than this take the int8 copy, others oneDNN's bfloat16 one."""
        if self._int8_only:
            return 1 << 62
        return DOTS_ROWS if self._dots_wide else ONEDNN_ROWS

    def _full(self, hidden: torch.Tensor) -> torch.Tensor:
        """The plain way: the whole float32 head, then its argmax."""
        return argmax_rows(self.head(hidden))


def chain_error(terms: int) -> float:
    """How far a float32 chain of `terms` multiply-adds (or products and sums) can be from the
    exact sum, relative to the sum of the terms' magnitudes: n u / (1 - n u), u = 2^-24 (2^-14.8
    for the default model's 576)."""
    nu = terms * 2.0**-24
    return nu / (1 - nu)


def _int8_copy(weight: torch.Tensor, chain: float, chunk: int = 8192
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values as float32 [vocab, hidden], scales [vocab], per-output bound factors F_v
    and norms N_v = |s_v q_v| of the module docstring, both rounded up; `chain`: chain_error of
    the hidden size) of a float32 [vocab, hidden] weight. F_v and N_v in float64, `chunk` rows
    at a time: s_v q_v and w_v are exact there, the norms' own error is far below the 2^-10
    they are raised by."""
    values, scales = quantize_int8(weight)
    factors, norms = [], []
    for start in range(0, weight.shape[0], chunk):
        w = weight[start:start + chunk].double()
        sq = values[start:start + chunk].double() * scales[start:start + chunk].double()[:, None]
        sq_norm = sq.norm(dim=1)
        f = (w - sq).norm(dim=1) + chain * (w.norm(dim=1) + sq_norm)
        factors.append((f * (1 + 2.0**-10)).float())
        norms.append((sq_norm * (1 + 2.0**-10)).float())
    return values, scales, torch.cat(factors), torch.cat(norms)


def pack_int8_dots(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, K] int8 values (as any dtype) -> (head_int8_dots' int8 [ceil(n / 64), ceil(K / 4),
    64, 4] panels, int32 [n padded to 64] sums of each output's values)."""
    q = values.to(torch.int8)
    q = F.pad(q, (0, -q.shape[1] % 4, 0, -q.shape[0] % PANEL))
    panels = q.view(q.shape[0] // PANEL, PANEL, q.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return panels.contiguous(), q.sum(1, dtype=torch.int32)
