"""The C++ CPU kernels (runtime/csrc), compiled once per machine and loaded as torch.ops.eaglebatch:

- paged_attention: attention read straight from the paged KV cache, for every row of a step
  (runtime.attention.cpu_backend);
- panel_linear: every float32 Linear product, on a panel-packed weight (float32 panels, or
  bfloat16 ones for weights that are exactly bfloat16; runtime.cpu_gemm); panel_linear_parts:
  the same product with its columns in separate tensors (fused q/k/v, gate/up);
- panel_entries: a few entries of a panel_linear product, the same bits (runtime.greedy_head);
- argmax_rows: the greedy sampler's argmax; head_candidates: the exact greedy head's candidates;
  head_int8_dots: its approximate logits at a few rows, from integer products (VNNI);
- rms_norm, rope: the decoder's norms and rotary embedding in one pass each (runtime.model,
  runtime.rope); write_kv: a step's K and V into their cache slots (the cpu attention backend).

The build uses torch.utils.cpp_extension (a C++ compiler and ninja; about 15 s the first time)
with -march=native (or $EAGLEBATCH_CPU_MARCH), cached by torch under its extensions directory
with the CPU's feature flags, the compiler's flags and a hash of the sources in the name. Where
it cannot be built, every user falls back to plain torch; EAGLEBATCH_CPU_KERNEL=0 turns the
kernels off.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_OPS = ("paged_attention", "panel_linear", "panel_linear_parts", "panel_entries", "panel_strip",
        "argmax_rows", "head_candidates", "head_int8_dots", "rms_norm", "rope", "write_kv")
# -fopenmp: at::parallel_for only runs on several threads when the extension itself is compiled
# with OpenMP (without it, every kernel ran on one thread whatever torch.set_num_threads said).
# The link names libgomp.so.1, the soname torch's wheel ships and has already loaded, so the
# kernels share torch's thread pool and its thread count. -ffp-contract=off: no multiply-add is
# fused unless the source says so (std::fma, _mm512_fmadd_ps), so the arithmetic is the source's.
# EAGLEBATCH_CPU_MARCH builds for another -march than this CPU's (haswell: the AVX2 code on an
# AVX-512 machine, to test or time it there; x86-64: the portable code).
_CFLAGS = ["-O3", f"-march={os.environ.get('EAGLEBATCH_CPU_MARCH') or 'native'}", "-fopenmp",
           "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]
_loaded: dict[str, bool] = {}
_library: list[Path] = []  # the loaded kernel library, once built


def load_cpu_kernels() -> bool:
    """Builds (first time only) and loads the kernels; False when that is not possible here (the
    reason is warned once)."""
    if "ok" in _loaded:
        return _loaded["ok"]
    ok = False
    if os.environ.get("EAGLEBATCH_CPU_KERNEL", "1") != "0":
        try:
            ok = _build()
        except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, a failed build...)
            warnings.warn(f"CPU kernels unavailable, using plain torch: {exc}", stacklevel=2)
    _loaded["ok"] = ok
    return ok


def _machine_tag() -> str:
    """One build per CPU feature set and source version, so a shared cache directory never hands
    one machine another's binary, nor an old build to new sources."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def _build() -> bool:
    from torch.utils import cpp_extension  # noqa: PLC0415  (slow import; only when building)

    name = f"eaglebatch_cpu_{_machine_tag()}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    with _build_lock(build_dir):
        # The name covers the sources' bytes, the flags and the CPU: a library built under it
        # is loaded as it is. cpp_extension.load would write build.ninja again with this copy
        # of the sources' paths, and ninja rebuilds (50-110 s) whenever another checkout of the
        # same sources built last.
        if not _load_built(built):
            print("eaglebatch: compiling the CPU kernels (once per machine, ~15 s)",
                  file=sys.stderr, flush=True)
            cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES],
                               extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                               is_python_module=False, verbose=False)
    _library[:] = [built]
    return all(hasattr(torch.ops.eaglebatch, op) for op in _OPS)


def _load_built(library: Path) -> bool:
    """Loads a library built before; False where there is none, or it does not load (a build
    killed while linking): it is built again."""
    if not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock (released by the kernel when its holder dies) over the build. torch marks
    a build in progress with a `lock` file that a killed builder leaves behind, and every later
    load then waits for it forever; every eaglebatch process takes this flock first, so a
    `lock` file found while holding it was left by a builder that died."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".eaglebatch-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether an inference-time op on these tensors may run as a C++ kernel: all contiguous
    float32 on the CPU, no autograd (the kernels have no backward) and the kernels loaded."""
    return (not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                    for t in tensors)
            and load_cpu_kernels())


def kernel_library() -> Path | None:
    """The shared library the kernels were loaded from (None when they are not loaded)."""
    return _library[0] if load_cpu_kernels() and _library else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for [rows, vocab] logits, by the C++ kernel on CPU tensors (16-bit ones
    widened to float32 first, which is exact and ~7x faster than torch's 16-bit argmax)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and load_cpu_kernels()):
        return torch.ops.eaglebatch.argmax_rows(logits.float().contiguous())
    return logits.argmax(-1)
