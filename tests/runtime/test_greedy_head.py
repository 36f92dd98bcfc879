"""The exact greedy head: bit for bit the argmax of the full float32 head, ties and near-ties
included; panel_entries gives the same bits as those entries of panel_linear."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_gemm import PrepackedLinear, prepack
from runtime.cpu_kernels import argmax_rows, load_cpu_kernels
from runtime.engine import Engine
from runtime.greedy_head import ExactGreedyHead, pack_int8_dots
from runtime.request import GenerationRequest
from runtime.weight_panels import pack_panels, quantize_int8


def pick_candidates_with(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which product picks the candidates, at any number of rows: the int8 copy ("panels", used
    below ONEDNN_ROWS or DOTS_ROWS rows: integer products with VNNI, else int8 panels) or the
    bfloat16 product from there on (any other)."""
    monkeypatch.setattr("runtime.greedy_head.ONEDNN_ROWS", 10**9 if path == "panels" else 1)
    monkeypatch.setattr("runtime.greedy_head.DOTS_ROWS", 10**9 if path == "panels" else 1)


@pytest.fixture(params=["panels", "onednn"])
def approx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    pick_candidates_with(str(request.param), monkeypatch)
    return str(request.param)


def test_panel_entries_are_the_panel_linear_bits() -> None:
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(9, 96)
    full = torch.ops.eaglebatch.panel_linear(x, pack_panels(weight), bias, 200)
    rows, cols = torch.randint(0, 9, (300,)), torch.randint(0, 200, (300,))
    got = torch.ops.eaglebatch.panel_entries(x, pack_panels(weight), bias, 200, rows, cols)
    assert torch.equal(got, full[rows, cols])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.eaglebatch.panel_entries(x, pack_panels(weight), bias, 200, rows[:1],
                                           torch.tensor([200]))


def head_of(vocab: int, hidden: int, seed: int) -> PrepackedLinear:
    torch.manual_seed(seed)
    head = prepack(nn.Linear(hidden, vocab, bias=False), head=True)
    assert isinstance(head, PrepackedLinear)
    return head


def signs(hidden: int) -> torch.Tensor:
    """A fixed random +-1 vector of `hidden` values, 0 in coordinate 0."""
    g = torch.Generator().manual_seed(hidden)
    sigma = torch.randint(0, 2, (hidden,), generator=g).float() * 2 - 1
    sigma[0] = 0.0
    return sigma


def exact_head_after_edit(head: PrepackedLinear) -> ExactGreedyHead:
    """The exact head of `head` after its weight was edited in place (panels packed again)."""
    head._packed = pack_panels(head.weight.detach())
    exact = ExactGreedyHead.for_head(head)
    assert exact is not None
    return exact


@pytest.mark.parametrize("kind", ["panels", "onednn", "matmul"])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_exact_head_equals_the_full_argmax(rows: int, kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pick_candidates_with(kind, monkeypatch)
    head = head_of(5000, 96, 0)
    exact = ExactGreedyHead.for_head(head)
    assert exact is not None
    # oneDNN packs bfloat16 weights where the CPU has bfloat16 instructions (AVX-512), not on
    # an AVX2 CPU, which takes the plain matmul
    bf16_cpu = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (exact._packed_bf16 is not None) == bf16_cpu
    # without bfloat16 instructions the int8 copy picks the candidates at every row count
    assert exact._int8_only == (not bf16_cpu)
    assert exact._int8_rows() == (1 << 62 if not bf16_cpu else 1 if kind != "panels" else 10**9)
    if kind == "matmul":  # the plain bfloat16 matmul, where torch cannot pack
        exact._packed_bf16 = None
        exact.weight_bf16_t = head.weight.detach().bfloat16().t().contiguous()
    g = torch.Generator().manual_seed(rows)
    for scale in (0.1, 3.0, 30.0):  # flat to peaked logits: few to many candidates
        x = torch.randn(rows, 96, generator=g) * scale
        assert torch.equal(exact.argmax(x), argmax_rows(head(x)))


@pytest.mark.parametrize("hidden", [96, 1500])
def test_int8_bound_is_tight_enough_and_holds_where_it_is_reached(
        hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head built so that the int8 bound is nearly reached: row A = s (q + 0.49 sigma) rounds
    to s q (each weight nearly half a step off, all along x = sigma), row B = s (q + tau) is
    exact in int8, with tau = sigma on 45% of the coordinates. A wins the float32 head by
    0.04 s m (m coordinates), but its int8 entry is 0.45 s m below B's: only a bound of at least
    ~0.9 of |x| |e_A| = 0.49 s m keeps A a candidate."""
    pick_candidates_with("panels", monkeypatch)
    head = head_of(700, hidden, 4)
    m = hidden - 1
    sigma = signs(hidden)
    q = torch.zeros(hidden)
    q[0] = 127.0  # sets the rows' int8 scale to s = 1/127; x[0] = 0 below
    tau = sigma * (torch.arange(hidden) % 20 < 9)  # 45% of the coordinates
    s = 1.0 / 127
    with torch.no_grad():
        head.weight.mul_(0.01)  # the other rows lose clearly
        head.weight[300] = s * (q + 0.49 * sigma)  # A
        head.weight[500] = s * (q + tau)  # B
    exact = exact_head_after_edit(head)
    x = sigma[None, :].clone()
    full = argmax_rows(head(x))
    assert full.tolist() == [300]  # A wins exactly
    approx, residual = exact._approx(x)  # x is exactly int8 (with VNNI): residual ~0
    assert approx.float()[0, 500] - approx.float()[0, 300] > 0.4 * s * m  # B leads by far
    assert exact.argmax(x).tolist() == [300]
    candidates = torch.ops.eaglebatch.head_candidates(
        approx, x.norm(dim=1), exact.int8_factors * 0.8, 1.0, 2.0**-8, 1e-30, residual,
        None if residual is None else exact.int8_norms)[1]
    assert 300 not in candidates.tolist()  # a bound 20% short would have lost A


@pytest.mark.parametrize(("hidden", "short"), [(96, 0.8), (1501, 0.6)])
def test_the_rows_rounding_term_is_tight_enough_and_holds_where_it_is_reached(
        hidden: int, short: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer products (VNNI): the rows are rounded to 16-bit integers too. x = (32767, 0.49
    sigma): its scale is 1 and every other coordinate rounds to 0, 0.49 off. Row A = (0, sigma)
    / 100 is exact in int8 and wins the float32 head by 0.02 m / 100, but its integer entry is
    0; row B = (0.47 m / 32767 / 100, 0, ...) is exact for x too and leads the integer product
    by 0.47 m / 100. Only the rows' rounding term |x - s_x p| N_A = 0.49 m / 100 keeps A a
    candidate: `short` of it would lose A (0.6 at 1,501 inputs, where the float32 chains' own
    term |x| F_A, larger with the inputs, makes up more of the bound)."""
    pick_candidates_with("panels", monkeypatch)
    head = head_of(700, hidden, 5)
    m = hidden - 1
    sigma = signs(hidden)
    with torch.no_grad():
        head.weight.mul_(0.001)  # the other rows lose clearly
        head.weight[:, 0] = 0.0
        head.weight[300] = sigma / 100  # A
        head.weight[500] = 0.0
        head.weight[500, 0] = 0.47 * m / 32767 / 100  # B
    exact = exact_head_after_edit(head)
    if exact.dots is None:
        pytest.skip("this CPU has no AVX-512 VNNI: the head keeps the float32 int8 panels")
    x = 0.49 * sigma[None, :]
    x[0, 0] = 32767.0
    assert argmax_rows(head(x)).tolist() == [300]  # A wins exactly
    approx, residual = exact._approx(x)
    assert residual is not None and approx.float()[0, 300] == 0  # A's coordinates round to 0
    assert approx.float()[0, 500] > 0.46 * m / 100  # B leads the integer product
    assert exact.argmax(x).tolist() == [300]
    candidates = torch.ops.eaglebatch.head_candidates(
        approx, x.norm(dim=1), exact.int8_factors, 1.0, 2.0**-8, 1e-30, residual * short,
        exact.int8_norms)[1]
    assert 300 not in candidates.tolist()


@pytest.mark.parametrize(("n", "k", "rows"), [(200, 96, 3), (4999, 577, 7), (64, 4, 1),
                                              (130, 1500, 5)])
def test_integer_products_are_the_exact_sums_scaled(n: int, k: int, rows: int) -> None:
    """head_int8_dots: the rows rounded to 16-bit integers (one scale each), the exact integer
    sums times both scales, in float32, the VNNI and the portable code alike; the rows'
    rounding error bounded from above (by at most 2^-19 more)."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g) * 3
    values, scales = quantize_int8(w)
    packed, column_sums = pack_int8_dots(values)
    padded = F.pad(scales, (0, -n % 64))
    native = torch.ops.eaglebatch.head_int8_dots(x, packed, column_sums, padded, n)
    portable = torch.ops.eaglebatch.head_int8_dots(x, packed, column_sums, padded, n, False)
    assert torch.equal(native[0], portable[0]) and torch.equal(native[1], portable[1])
    sx = x.abs().amax(1) / 32767
    p = (x / sx[:, None]).round().clamp(-32767, 32767)
    want = (p.long() @ values.long().T).float() * (sx[:, None] * scales[None, :])
    assert torch.equal(native[0], want)
    exact_residual = (x.double() - sx[:, None].double() * p.double()).norm(dim=1)
    ratio = native[1].double() / exact_residual
    assert bool((ratio >= 1).all()) and bool((ratio < 1 + 2.0**-19).all())
    x[-1, 3] = float("nan")  # a row that is not finite: NaN throughout (the full head takes it)
    a, r = torch.ops.eaglebatch.head_int8_dots(x, packed, column_sums, padded, n)
    assert bool(a[-1].isnan().all()) and bool(r[-1].isnan())
    assert torch.equal(a[:-1], native[0][:-1]) and torch.equal(r[:-1], native[1][:-1])


@pytest.mark.parametrize("second", [False, True])  # with the rows' rounding term or without
@pytest.mark.parametrize("n", [5000, 4999])  # a multiple of 16, and a vector tail
def test_candidates_are_exactly_those_within_the_bound(n: int, second: bool) -> None:
    """head_candidates against the rule written in torch (the same float32 operations in the
    same order): every (row, v) with a_v + B_v >= max_u (a_u - B_u), row-major."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    g = torch.Generator().manual_seed(n)
    rows = 7
    approx = (torch.randn(rows, n, generator=g) * 0.02).bfloat16()
    approx[3, 17] = 40.0  # a clear winner: one candidate in that row
    hidden_norm = torch.rand(rows, generator=g) * 10
    weight_norm = torch.rand(n, generator=g)
    residual, norms = torch.rand(rows, generator=g) * 0.1, torch.rand(n, generator=g)
    c1, c2, slack = 2.0**-8, 2.0**-8, 1e-30
    a = approx.float()
    term = (torch.tensor(c1, dtype=torch.float32) * hidden_norm)[:, None] * weight_norm
    if second:
        term = term + residual[:, None] * norms
    bound = term + torch.tensor(c2, dtype=torch.float32) * a.abs() \
        + torch.tensor(slack, dtype=torch.float32)
    floor = (a - bound).amax(dim=1, keepdim=True)
    want_rows, want_cols = (a + bound >= floor).nonzero(as_tuple=True)
    extra = (residual, norms) if second else (None, None)
    got_rows, got_cols, finite = torch.ops.eaglebatch.head_candidates(
        approx, hidden_norm, weight_norm, c1, c2, slack, *extra)
    assert finite and len(want_rows) > rows  # several candidates in most rows
    assert torch.equal(got_rows, want_rows) and torch.equal(got_cols, want_cols)
    assert got_cols[got_rows == 3].tolist() == [17]
    approx[5, n - 1] = float("inf")  # the last entry: the scalar tail when n % 16 != 0
    assert not torch.ops.eaglebatch.head_candidates(approx, hidden_norm, weight_norm, c1, c2,
                                                    slack, *extra)[2]


def test_ties_and_near_ties_follow_argmax_rows(approx: str) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(64, 300, bias=False)
    with torch.no_grad():
        w = linear.weight
        w[7] = w[200]  # exact ties: the first index wins
        w[9] = w[100] * (1 + 2.0**-20)  # logits a few ulps apart: bfloat16 cannot tell them
        w[11] = w[250] + 2.0**-23 * w[250].sign()
    head = PrepackedLinear(linear, pack_panels(linear.weight.detach()), "panel", (1, None))
    exact = ExactGreedyHead.for_head(head)
    assert exact is not None
    x = torch.stack([w[200], w[100], w[250], -w[3]]).detach() * 5  # winners among the pairs
    full = argmax_rows(head(x))
    assert full[0] == 7 and set(full[1:3].tolist()) <= {9, 100, 11, 250}
    assert torch.equal(exact.argmax(x), full)


def test_non_finite_rows_take_the_full_head(approx: str) -> None:
    head = head_of(500, 32, 2)
    exact = ExactGreedyHead.for_head(head)
    assert exact is not None
    x = torch.randn(3, 32)
    x[1, 4] = float("nan")
    assert torch.equal(exact.argmax(x), argmax_rows(head(x)))


def test_off_where_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ExactGreedyHead.for_head(nn.Linear(8, 20)) is None  # not on panels
    assert ExactGreedyHead.for_head(prepack(nn.Linear(8, 70), int8=True)) is None
    biased = prepack(nn.Linear(8, 70), head=True)  # its candidates would leave the bias out
    assert isinstance(biased, PrepackedLinear) and ExactGreedyHead.for_head(biased) is None
    monkeypatch.setenv("EAGLEBATCH_EXACT_HEAD", "0")
    assert ExactGreedyHead.for_head(head_of(100, 8, 3)) is None


def test_engine_tokens_are_the_same_with_and_without_it(tiny_model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 250, (n,), generator=g).tolist() for n in range(3, 15)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run() -> tuple[Engine, dict[str, tuple[int, ...]]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4))
        requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
        return engine, {c.request_id: c.token_ids for c in engine.generate(requests)}

    engine, with_it = run()
    assert engine.runner.exact_head is not None
    monkeypatch.setenv("EAGLEBATCH_EXACT_HEAD", "0")
    engine, without = run()
    assert engine.runner.exact_head is None and with_it == without
