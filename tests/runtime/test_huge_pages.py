"""Packed weights in transparent huge pages: moved in place with their values, views kept views,
all in mappings advised for huge pages; an engine's tokens the same with and without."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_gemm import FusedPanels, PrepackedLinear, packed_tensors
from runtime.cpu_kernels import load_cpu_kernels
from runtime.engine import Engine
from runtime.huge_pages import HUGE_PAGE, huge_pages_available, keep_in_huge_pages
from runtime.request import GenerationRequest

needs_huge_pages = pytest.mark.skipif(
    not huge_pages_available(), reason="no transparent huge pages on this machine")


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` carries madvise(MADV_HUGEPAGE) ('hg' in VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"{address:#x} is in no mapping")


@needs_huge_pages
def test_moved_tensors_keep_values_views_and_share_one_advised_mapping() -> None:
    torch.manual_seed(0)
    panels = torch.randn(300, 64)
    head, tail = panels[:100], panels[100:]  # views, as fused parts' panels
    codes = torch.randint(-127, 128, (5000,), dtype=torch.int8)
    column = panels[:, 3]  # not contiguous
    want = [t.clone() for t in (panels, head, tail, codes, column)]
    moved = keep_in_huge_pages([panels, head, tail, None, codes, column])
    assert moved == panels.nbytes + codes.nbytes
    for got, expected in zip((panels, head, tail, codes, column), want, strict=True):
        assert torch.equal(got, expected)
    storage = panels.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (head, tail, column))
    assert panels.data_ptr() % HUGE_PAGE == 0  # the first storage starts on a huge page
    assert head.data_ptr() == panels.data_ptr()
    assert tail.data_ptr() == panels.data_ptr() + 100 * 64 * 4
    assert column.stride() == (64,) and column.data_ptr() == panels.data_ptr() + 3 * 4
    assert codes.data_ptr() >= panels.data_ptr() + panels.nbytes
    assert advised_for_huge_pages(panels.data_ptr()) and advised_for_huge_pages(codes.data_ptr())
    panels[150, 7] = 42.0  # still one tensor and its views
    assert tail[50, 7] == 42.0 and column.shape == (300,)


def test_nothing_moves_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLEBATCH_HUGE_PAGES", "0")
    assert not huge_pages_available()
    t = torch.ones(1 << 16)
    before = t.data_ptr()
    assert keep_in_huge_pages([t]) == 0 and t.data_ptr() == before


def _tokens(model_dir: Path) -> tuple[Engine, list[tuple[int, ...]]]:
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=1 << 20))
    requests = [GenerationRequest(str(i), tuple(range(3 + i, 12 + 2 * i)),
                                  SamplingParams(max_tokens=12, ignore_eos=True))
                for i in range(3)]
    done = sorted(engine.generate(requests), key=lambda c: c.request_id)
    return engine, [c.token_ids for c in done]


@needs_huge_pages
def test_an_engine_keeps_its_packed_weights_in_huge_pages(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not load_cpu_kernels():
        pytest.skip("panels need the C++ kernels")
    engine, tokens = _tokens(tiny_model_dir)
    packed = packed_tensors(engine.model)
    assert packed and all(advised_for_huge_pages(t.data_ptr()) for t in packed)
    # all in the one mapping lay_out_for_cpu made (its storage)
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    head = engine.runner.exact_head
    assert head is not None
    copies = [t for t in (*(head.dots or ()), head.panels_int8, head.weight_norms) if t is not None]
    assert all(advised_for_huge_pages(t.data_ptr()) for t in copies)
    # fused parts still read slices of their fused panels (no second copy kept alive)
    for layer in engine.model.model.layers:
        mlp = layer.mlp  # type: ignore[union-attr]
        fused = mlp.gate_up
        assert isinstance(fused, FusedPanels)
        for part in (mlp.gate_proj, mlp.up_proj):
            assert isinstance(part, PrepackedLinear)
            assert part._packed.untyped_storage().data_ptr() == \
                fused._packed.untyped_storage().data_ptr()
    monkeypatch.setenv("EAGLEBATCH_HUGE_PAGES", "0")
    plain, plain_tokens = _tokens(tiny_model_dir)
    # each packed copy (or fused group) on its own storage from the heap, not one mapping (whether
    # the heap has huge pages is not ours to say: numpy, for one, advises its large arrays' pages)
    assert len({t.untyped_storage().data_ptr() for t in packed_tensors(plain.model)}) > 1
    assert tokens == plain_tokens and all(len(t) == 12 for t in tokens)


@needs_huge_pages
def test_a_mapping_that_cannot_be_made_leaves_the_tensors_where_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr("runtime.huge_pages.huge_page_buffer", refuse)
    t = torch.arange(1 << 16, dtype=torch.float32)
    before = t.data_ptr()
    with pytest.warns(UserWarning, match="stay in ordinary pages: .*Cannot allocate"):
        assert keep_in_huge_pages([t]) == 0
    assert t.data_ptr() == before and torch.equal(t, torch.arange(1 << 16, dtype=torch.float32))
