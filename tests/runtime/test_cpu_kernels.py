"""The CPU kernels: panel_linear's rows do not depend on the other rows of the product, the
threads or the instruction set it was built for; its parts are its columns; the argmax kernel
answers as torch does; a build's leftover lock or another checkout's build.ninja does not stop
the library from loading."""

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

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_kernels import argmax_rows, kernel_library, load_cpu_kernels
from runtime.engine import Engine
from runtime.request import GenerationRequest
from runtime.weight_panels import int8_panels, pack_panels, quantize_int8


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
    code = ("import torch; from tests.runtime.test_cpu_kernels import kernel_outputs; "
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
