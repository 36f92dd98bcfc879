"""CPU weight layouts: values and parameter identity unchanged, products equal F.linear on every
kernel (BLAS outside the packed row range; panel_linear or oneDNN inside it); panel_linear's rows
do not depend on the other rows of the product; the argmax kernel answers as torch does."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_gemm import (
    ONEDNN_DECODER_ROWS,
    PANEL_ROWS,
    PrepackedLinear,
    fuse_panels,
    lay_out_for_cpu,
    prepack,
    transpose_linear_weights,
)
from runtime.cpu_kernels import argmax_rows, kernel_library, load_cpu_kernels
from runtime.engine import Engine
from runtime.model import CausalLM
from runtime.request import GenerationRequest
from runtime.weight_panels import int8_panels, pack_panels, quantize_int8


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


@pytest.mark.parametrize("k", [96, 300])
def test_panel_linear_rows_do_not_depend_on_the_other_rows(k: int) -> None:
    """Bitwise: each row of a 1..200-row product (tiles of 6; on a panel, with AVX-512 2 to 8
    tiles in k-blocks of 64 inputs, with AVX2 from 4 tiles in k-blocks of 128; passes of 192
    rows) equals the same row computed alone."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    weight, bias = torch.randn(200, k), torch.randn(200)
    panels = pack_panels(weight)
    strip = torch.ops.eaglebatch.panel_strip()  # 8 with AVX2, 64 (whole panels) otherwise
    assert panels.shape == (4, 64 // strip, k, strip)
    columns = panels.transpose(2, 3).reshape(4, 64, k)  # [panel, column, input]
    assert torch.equal(columns.reshape(256, k)[:200], weight)
    assert torch.equal(columns[3, 8:], torch.zeros(56, k))
    x = torch.randn(200, k)
    alone = torch.cat([torch.ops.eaglebatch.panel_linear(x[i:i + 1], panels, bias, 200)
                       for i in range(200)])
    # (other summation orders: 300 terms of randn products differ by up to ~1.5e-5)
    torch.testing.assert_close(alone, F.linear(x, weight, bias), rtol=1e-5, atol=5e-5)
    for rows in (2, 3, 4, 5, 6, 7, 13, 18, 19, 24, 25, 48, 49, 96, 100, 192, 200):
        product = torch.ops.eaglebatch.panel_linear(x[:rows].contiguous(), panels, bias, 200)
        assert torch.equal(product, alone[:rows]), rows
    shifted = torch.ops.eaglebatch.panel_linear(x[1:8].contiguous(), panels, bias, 200)
    assert torch.equal(shifted, alone[1:8])  # a row's place in its tile does not matter either


def test_kernels_run_on_torchs_threads_with_the_same_bits() -> None:
    """The kernel library is built with OpenMP (at::parallel_for is serial without it) and names
    libgomp.so.1, the runtime torch has loaded; a product is the same bits on 1 and 3 threads."""
    library = kernel_library()
    assert library is not None and shutil.which("readelf"), "no kernel library or no readelf"
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True,
                             check=True).stdout
    assert "[libgomp.so.1]" in dynamic
    torch.manual_seed(0)
    weight, x = torch.randn(1000, 96), torch.randn(37, 96)
    panels = pack_panels(weight)
    threads = torch.get_num_threads()
    try:
        products = []
        for n in (1, 3):
            torch.set_num_threads(n)
            products.append(torch.ops.eaglebatch.panel_linear(x, panels, None, 1000))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(products[0], products[1])
    torch.testing.assert_close(products[0], F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_single_tiles_panels_split_among_threads_give_the_same_bits(kind: str) -> None:
    """Products of 1-6 rows over 9 panels (the last one 38 columns wide): on 2 threads each
    thread takes 4 1/2 panels (the middle one by columns), on 3 and 4 threads other splits;
    every split gives the bits of one thread, bias and int8 scales included."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    n, k = 9 * 64 - 26, 96
    weight, bias = torch.randn(n, k), torch.randn(n)
    scales = None
    if kind == "int8":
        values, scale = quantize_int8(weight)
        panels, scales = int8_panels(values, scale)
        reference = values * scale[:, None]
    else:
        reference = weight.bfloat16().float() if kind == "bfloat16" else weight
        panels = pack_panels(reference.bfloat16() if kind == "bfloat16" else reference)
    x = torch.randn(6, k)
    threads = torch.get_num_threads()
    try:
        products = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            products.append([torch.ops.eaglebatch.panel_linear(x[:rows].contiguous(), panels,
                                                               bias, n, scales)
                             for rows in range(1, 7)])
    finally:
        torch.set_num_threads(threads)
    for split in products[1:]:
        for rows, (one, many) in enumerate(zip(products[0], split, strict=True), start=1):
            assert torch.equal(one, many), rows
    torch.testing.assert_close(products[0][5], F.linear(x, reference, bias), rtol=1e-5,
                               atol=1e-5)


def kernel_outputs(model_dir: str) -> dict[str, torch.Tensor]:
    """What every build of the kernels must give alike (test_every_instruction_set_gives_the_
    same_bits runs this in another process too): products of float32, bfloat16 and int8 panels
    with a bias, 9 panels (the last 38 columns wide), K over several k-blocks, at 1-7, 12, 13, 18
    and 49 rows (single tiles, half panels, k-blocked tiles) on 1, 2 and 4 threads (on 4, the
    last panel's halves go to two threads, its second half 6 columns wide); and the greedy
    tokens of the checkpoint in model_dir for four prompts batched together (its prompts'
    attention, decode attention, norms, rotary embedding and argmax: a random model's logits
    are close, so its tokens follow the last bits)."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(0)
    n, k = 9 * 64 - 26, 160
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(49, k)
    values, scale = quantize_int8(weight)
    panels = {"float32": (pack_panels(weight), None),
              "bfloat16": (pack_panels(weight.bfloat16()), None),
              "int8": int8_panels(values, scale)}
    threads, outputs = torch.get_num_threads(), {}
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            for kind, (packed, scales) in panels.items():
                for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 18, 49):
                    outputs[f"{kind} {rows} rows {count} threads"] = (
                        torch.ops.eaglebatch.panel_linear(x[:rows].contiguous(), packed, bias,
                                                          n, scales))
        torch.set_num_threads(2)
        engine = Engine(EngineConfig(model=model_dir, kv_cache_memory=1 << 20))
        requests = [GenerationRequest(str(i), tuple(range(5 + 7 * i, 8 + 30 * i)),
                                      SamplingParams(max_tokens=24, ignore_eos=True))
                    for i in range(4)]
        for done in engine.generate(requests):
            outputs[f"tokens {done.request_id}"] = torch.tensor(done.token_ids)
    finally:
        torch.set_num_threads(threads)
    return outputs


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="x86 builds (-march=haswell, x86-64)")
@pytest.mark.parametrize(("march", "strip"), [("haswell", 8), ("x86-64", 64)])
def test_every_instruction_set_gives_the_same_bits(tmp_path: Path, tiny_model_dir: Path,
                                                   march: str, strip: int) -> None:
    """The kernels built for AVX2 (-march=haswell: panels in strips of 8 columns, as on AMD's
    CPUs without AVX-512) and the portable code (-march=x86-64, what other CPUs run) give this
    build's bits, whatever this CPU has: kernel_outputs, computed by another process on its own
    build."""
    if march == "haswell" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 build")
    native = kernel_outputs(str(tiny_model_dir))
    out = tmp_path / "outputs.pt"
    code = ("import torch; from tests.runtime.test_cpu_gemm import kernel_outputs; "
            "from runtime.cpu_kernels import kernel_library; "
            f"torch.save(kernel_outputs({str(tiny_model_dir)!r}), {str(out)!r}); "
            "print(torch.ops.eaglebatch.panel_strip(), kernel_library())")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=root, env=os.environ | {"EAGLEBATCH_CPU_MARCH": march},
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    *_, layout, library = done.stdout.split()
    assert layout == str(strip)  # that build's panels
    assert library != str(kernel_library())  # a library of its own, not this one
    other = torch.load(out)
    assert other.keys() == native.keys()
    for name, output in native.items():
        assert torch.equal(output, other[name]), name


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


def test_argmax_kernel_answers_as_torch_does() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[1, 7] = float("nan")  # the first NaN wins, as in torch
    logits[2] = float("-inf")
    logits[3, [3, 9]] = logits[3].max() + 1  # ties: the first index
    logits[4, [10, 500]] = float("nan")
    want = logits.argmax(-1)
    assert want.tolist()[1:5] == [7, 0, 3, 10]
    assert torch.equal(argmax_rows(logits), want)
    assert torch.equal(argmax_rows(logits[:, :999]), logits[:, :999].argmax(-1))  # strided view
    for dtype in (torch.bfloat16, torch.float16):  # widened to float32 (exact), then the kernel
        narrow = logits.to(dtype)
        narrow[5, [20, 21]] = narrow[5].max() + 1  # a tie made by the rounding of the others
        assert torch.equal(argmax_rows(narrow), narrow.argmax(-1))


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


def test_panel_linear_parts_are_the_columns_of_panel_linear() -> None:
    """The parts (whole panels but the last, which may be ragged) hold panel_linear's columns,
    bit for bit; parts that split a panel or do not add up to the panels are refused."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    torch.manual_seed(5)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    panels, x = pack_panels(weight), torch.randn(9, 96)
    whole = torch.ops.eaglebatch.panel_linear(x, panels, bias, 200)
    parts = torch.ops.eaglebatch.panel_linear_parts(x, panels, bias, [64, 64, 72])
    assert [tuple(p.shape) for p in parts] == [(9, 64), (9, 64), (9, 72)]
    assert torch.equal(torch.cat(parts, dim=1), whole)
    with pytest.raises(RuntimeError, match="whole panels"):
        torch.ops.eaglebatch.panel_linear_parts(x, panels, bias, [100, 100])
    with pytest.raises(RuntimeError, match="panels must be"):
        torch.ops.eaglebatch.panel_linear_parts(x, panels, bias, [64, 64])


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path: Path) -> None:
    """torch marks a build with a `lock` file; a build killed with SIGKILL left it, and every
    later load waited for it forever. A copy of this machine's build, with such a file."""
    library = kernel_library()
    assert library is not None
    build = tmp_path / library.parent.name
    shutil.copytree(library.parent, build)
    (build / "lock").write_text("")
    code = "from runtime.cpu_kernels import load_cpu_kernels; print(load_cpu_kernels())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
    assert not (build / "lock").exists()


def test_a_library_built_from_another_copy_of_the_sources_is_loaded_not_rebuilt(
        tmp_path: Path) -> None:
    """Two checkouts of the same sources share the build (its name covers their bytes): each
    load used to rewrite build.ninja with its own paths, and ninja rebuilt (50-110 s). Here
    the build.ninja names other paths and the compiler cannot run: the library still loads."""
    library = kernel_library()
    assert library is not None
    build = tmp_path / library.parent.name
    shutil.copytree(library.parent, build)
    ninja = build / "build.ninja"
    if ninja.exists():
        ninja.write_text(ninja.read_text().replace(str(Path(__file__).resolve().parents[2]),
                                                   "/elsewhere/checkout"))
    code = "from runtime.cpu_kernels import load_cpu_kernels; print(load_cpu_kernels())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path),
                               "CXX": "/nonexistent/c++", "PATH": "/nonexistent"})
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
    assert "compiling" not in done.stderr
