"""The packed weight formats that panel_linear (runtime/csrc/linear.cpp) reads.

- Float32 panels (pack_panels): output columns 64 at a time, in the strips the CPU's vector width
  wants. A float32 weight whose values are all exactly bfloat16 (a drafter stored in bfloat16 and
  run in float32) is packed as bfloat16 panels: panel_linear widens them on load, so its products
  are the same bits, and a product at a few rows (bound by reading the weights) reads half the
  bytes.
- Int8 panels (quantize_int8, int8_panels): one float32 scale per output column, a quarter of
  float32's bytes. Only for a drafter (EngineConfig.draft_int8): drafts may change (rarely:
  acceptance 1.726 -> 1.715 for the shipped drafter), outputs never (verification decides every
  emitted token); the drafter's 15 MB then stay in the last-level cache from one draft step to
  the next.
- 4-bit panels (q4_panels): a float32 weight whose every value is exactly fma(d, q, m), q in
  0..15 and one d and m per 32 inputs of an output (GGUF's Q4_1 dequantized: the default model's
  decoder). The kernel rebuilds each weight exactly and runs the same FMA chain, the same bits,
  reading 3/16 of the float32 panels' bytes (EngineConfig.q4_panels; 30 layers of the default
  model at 1 / 3 / 6 rows: 14.3 / 14.6 / 14.7 -> 4.5 / 5.8 / 8.5 ms, at 8 / 12 rows 14.0 / 16.3
  -> 12.4 / 16.1, AMD EPYC, 2 threads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.cpu_kernels import load_cpu_kernels

PANEL = 64  # output columns per panel (linear.cpp's kPanel)
Q4_BLOCK = 32  # inputs per d and m of 4-bit panels


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 64), 64 / strip, in, strip]: panel p holds output columns
    64p .. 64p + 63 of weight.T, zero past `out`, as strips of `strip` columns (the layout
    panel_linear reads: whole panels with AVX-512, strips of 8 with AVX2; panel_strip())."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    strip = torch.ops.eaglebatch.panel_strip() if load_cpu_kernels() else PANEL
    padded = weight.detach()
    if out_features % PANEL:  # (F.pad copies even when it pads nothing)
        padded = F.pad(padded, (0, 0, 0, num_panels * PANEL - out_features))
    return (padded.reshape(num_panels, PANEL // strip, strip, in_features).transpose(2, 3)
            .contiguous())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (its values rounded to integers in [-127, 127] (float32), [out] scales)
    with weight ~= values * scales[:, None]: symmetric, one scale per output (row)."""
    peak = weight.detach().abs().amax(dim=1)
    scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    return (weight.detach() / scales.unsqueeze(1)).round_().clamp_(-127, 127), scales


def int8_panels(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8's (values, scales) as panel_linear takes them: int8 panels, and the
    scales padded to whole panels."""
    return pack_panels(values.to(torch.int8)), F.pad(scales, (0, -len(scales) % PANEL))


def exactly_bfloat16(weight: torch.Tensor, chunk: int = 1024) -> bool:
    """Every value is a bfloat16 value. The first row answers for almost every true float32
    weight, so start-up does not convert the whole target (~0.16 s for the default model); the
    rest is checked `chunk` rows at a time (a whole 128k-row head at once took 1.5 GiB more)."""
    if not torch.equal(weight[:1], weight[:1].bfloat16().float()):
        return False
    return all(torch.equal(w, w.bfloat16().float()) for w in weight.split(chunk))


def q4_panels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """4-bit panels of a float32 [out, in] weight whose every value is exactly fma(d, q, m),
    q in 0..15, with one d and m per Q4_BLOCK inputs of each output (GGUF's Q4_1 dequantized):
    (nibbles [panels, in, 32] uint8, byte j of panel row c = q of column j | q of column j + 32
    << 4; dm [panels, in / 32, 2, 64] float32: d of the 64 columns, then m). None when `in` is
    not a multiple of Q4_BLOCK or when any weight is not rebuilt bit for bit."""
    out_features, in_features = weight.shape
    if in_features % Q4_BLOCK or weight.dtype != torch.float32:
        return None
    blocks = in_features // Q4_BLOCK
    num_panels = -(-out_features // PANEL)
    codes = torch.zeros(num_panels * PANEL, in_features, dtype=torch.uint8)
    dm = torch.zeros(2, num_panels * PANEL, blocks)
    w = weight.detach().reshape(out_features, blocks, Q4_BLOCK)
    for start in range(0, out_features, _Q4_CHECK_ROWS):  # temporaries that stay in cache
        found = _q4_codes(w[start:start + _Q4_CHECK_ROWS])
        if found is None:
            return None
        stop = start + found[0].shape[0]
        codes[start:stop] = found[0].reshape(stop - start, in_features)
        dm[0, start:stop], dm[1, start:stop] = found[1], found[2]
    codes = codes.view(num_panels, PANEL, in_features).transpose(1, 2)  # [panels, in, 64]
    nibbles = (codes[..., :PANEL // 2] | (codes[..., PANEL // 2:] << 4)).contiguous()
    return nibbles, dm.view(2, num_panels, PANEL, blocks).permute(1, 3, 0, 2).contiguous()


_Q4_CHECK_ROWS = 256  # outputs checked at a time by q4_panels


def _q4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [n, blocks, 32], d [n, blocks], m [n, blocks]) of float32 weights [n, blocks,
    32] that are all exactly fma(d, q, m), else None. Per block, m is its least value (q = 0)
    and d its range / 15 in float16, as llama.cpp's quantizer sets them (in float32). d * q is
    exact in float32 (11 + 4 significant bits), so d * q + m rounds once, as an FMA does: the
    check below is the kernel's own rebuild, bit for bit."""
    low = w.amin(dim=-1)
    if not bool(torch.isfinite(low).all()) or not torch.equal(low.half().float(), low):
        return None
    d = ((w.amax(dim=-1) - low) / 15).half().float()
    if not bool(torch.isfinite(d).all()):
        return None
    q = (w - low.unsqueeze(-1)).div_(d.clamp(min=1e-30).unsqueeze(-1)).round_().clamp_(0, 15)
    rebuilt = torch.addcmul(low.unsqueeze(-1), d.unsqueeze(-1), q)
    if not torch.equal(rebuilt.view(torch.int32), w.view(torch.int32)):
        return None
    return q.to(torch.uint8), d, low
