"""The cpu backend (the C++ kernel, for every row) against the torch backend over one scattered
paged cache: decode rows, draft-verification rows and prefill chunks in one pass, with and
without a sliding window, for GQA and plain multi-head layouts; and the kernel's bits against
themselves across batches, chunkings, paths and thread counts."""
from __future__ import annotations

import platform
from collections.abc import Iterable

import pytest
import torch

from runtime.attention import build_attention_metadata, choose_backend_name
from runtime.attention.cpu_backend import CpuAttentionBackend
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.cpu_kernels import load_cpu_kernels

BLOCK_SIZE = 16
NUM_BLOCKS = 64
QUERY_LENS = [1, 3, 4, 1, 16, 17, 40, 2, 1]  # 16 and 17: one tile of the kernel, and one more
SEQ_LENS = [5, 100, 37, 16, 17, 17, 120, 33, 250]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"


def _inputs(heads: int, kv_heads: int, dim: int, query_lens: list[int], seq_lens: list[int],
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, generator=generator)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()  # 0: null block
    tables = []
    for n in seq_lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(free[:blocks])
        free = free[blocks:]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for q, n, t in zip(query_lens, seq_lens, tables, strict=True) for p in range(n - q, n)]
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, dim, generator=generator)
    key = torch.randn(tokens, kv_heads, dim, generator=generator)
    value = torch.randn(tokens, kv_heads, dim, generator=generator)
    md = build_attention_metadata(query_lens, seq_lens, tables, slots, torch.device("cpu"))
    return query, key, value, cache, md  # type: ignore[return-value]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 40), (8, 1, 16)])
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_backend_matches_torch_backend(heads: int, kv_heads: int, dim: int,
                                           window: int | None) -> None:
    query, key, value, cache, md = _inputs(heads, kv_heads, dim, QUERY_LENS, SEQ_LENS)
    scale = dim**-0.5
    want_cache = cache.clone()
    want = TorchAttentionBackend(scale, window).forward(query, key, value, want_cache, md)
    got = CpuAttentionBackend(scale, window).forward(query, key, value, cache, md)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.equal(cache, want_cache)  # the new K and V were written to the same slots


def test_cpu_kernel_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    """A decode row's output is bitwise the same alone or next to other rows (what lets spec and
    plain decoding produce equal tokens)."""
    query, key, value, cache, md = _inputs(9, 3, 64, [1, 3, 1], [50, 80, 120])
    backend = CpuAttentionBackend(64**-0.5)
    together = backend.forward(query, key, value, cache.clone(), md)
    alone_md = build_attention_metadata([1], [120], [md.block_table[2].tolist()],
                                        md.slot_mapping[4:].tolist(), torch.device("cpu"))
    alone = backend.forward(query[4:], key[4:], value[4:], cache.clone(), alone_md)
    assert torch.equal(together[4:], alone)


def test_cpu_kernel_paths_give_the_same_bits() -> None:
    """The kernel splits its work by batch (a few tiles: one work item per KV head; many tiles:
    every KV head at once); a request verifying 3 drafts over 400 cached tokens gets the same
    bits alone and next to 7 others."""
    query, key, value, cache, md = _inputs(9, 3, 64, [3] + [1] * 7, [400] + [20] * 7)
    backend = CpuAttentionBackend(64**-0.5)
    alone_md = build_attention_metadata([3], [400], [md.block_table[0].tolist()],
                                        md.slot_mapping[:3].tolist(), torch.device("cpu"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # "a few tiles" is counted per thread
        together = backend.forward(query, key, value, cache.clone(), md)
        alone = backend.forward(query[:3], key[:3], value[:3], cache.clone(), alone_md)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[:3], alone)
    assert not torch.equal(together[:3], together[3:6])  # not trivially equal


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("chunks", [[17, 30, 23], [5, 65], [16, 16, 16, 16, 6], [69, 1]])
def test_a_prompt_gets_the_same_bits_in_one_chunk_or_several(window: int | None,
                                                              chunks: list[int]) -> None:
    """A 70-token prompt prefilled in one step or cut into chunks (as the token budget, a
    prefix-cache hit or a recompute after preemption cut it), here beside a decode row of
    another sequence: every query's output is the same bits. This is what keeps greedy tokens
    equal with and without a drafter, whose verification rows change the cut."""
    query, key, value, cache, md = _inputs(9, 3, 64, [70, 1], [70, 90])
    backend = CpuAttentionBackend(64**-0.5, window)
    whole_cache = cache.clone()
    whole = backend.forward(query, key, value, whole_cache, md)
    table, other = md.block_table[0].tolist(), md.block_table[1].tolist()
    slots = md.slot_mapping.tolist()
    parts, start = [], 0
    for n in chunks:
        end = start + n
        rows = [*range(start, end), 70]  # the chunk, then the other sequence's decode row
        step = build_attention_metadata([n, 1], [end, 90], [table, other],
                                        [slots[r] for r in rows], torch.device("cpu"))
        parts.append(backend.forward(query[rows], key[rows], value[rows], cache, step)[:n])
        start = end
    assert torch.equal(torch.cat(parts), whole[:70])
    assert torch.equal(cache, whole_cache)


def test_cpu_kernel_gives_the_same_bits_on_any_number_of_threads() -> None:
    query, key, value, cache, md = _inputs(9, 3, 64, QUERY_LENS, SEQ_LENS)
    backend = CpuAttentionBackend(64**-0.5)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 3):
            torch.set_num_threads(n)
            outputs.append(backend.forward(query, key, value, cache.clone(), md))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


def test_an_empty_step_gives_an_empty_output() -> None:
    md = build_attention_metadata([], [], [], [], torch.device("cpu"))
    query, kv = torch.empty(0, 4, 16), torch.empty(0, 2, 16)
    cache = torch.randn(2, 4, 4, 2, 16)
    for backend in (CpuAttentionBackend(0.25), TorchAttentionBackend(0.25)):
        assert backend.forward(query, kv, kv, cache, md).shape == (0, 4, 16)


def test_auto_picks_the_cpu_backend_on_the_cpu() -> None:
    assert choose_backend_name("auto", torch.device("cpu")) == "cpu"
    assert choose_backend_name("torch", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_kernel_gives_the_float32_result_on_the_widened_inputs_rounded_once(
        dtype: torch.dtype) -> None:
    query, key, value, cache, md = _inputs(9, 3, 64, QUERY_LENS, SEQ_LENS)
    narrow = [t.to(dtype) for t in (query, key, value, cache)]
    backend = CpuAttentionBackend(64**-0.5, 20)
    got_cache = narrow[3].clone()
    got = backend.forward(*narrow[:3], got_cache, md)
    wide_cache = narrow[3].float()
    want = backend.forward(*(t.float() for t in narrow[:3]), wide_cache, md)
    assert got.dtype == dtype and torch.equal(got_cache, wide_cache.to(dtype))
    assert torch.equal(got, want.to(dtype))  # prefill chunks too: every row is the kernel's


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_cuda_path_repeats_kv_heads_and_gives_the_gqa_result(heads: int, kv_heads: int) -> None:
    """The torch backend's CUDA path (the memory-efficient kernel, which takes no enable_gqa with
    a mask) repeats KV heads itself; here it runs on its math fallback against SDPA's own GQA."""
    from runtime.attention.torch_backend import attend_without_cudnn

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(3, heads, 4, 32, generator=generator)
    k = torch.randn(3, kv_heads, 48, 32, generator=generator)
    v = torch.randn(3, kv_heads, 48, 32, generator=generator)
    kv_lens = torch.tensor([48, 20, 7])  # row r: query i sits at kv_len - 4 + i
    qpos = (kv_lens - 4).view(-1, 1, 1) + torch.arange(4).view(1, -1, 1)
    mask = (torch.arange(48).view(1, 1, -1) <= qpos).unsqueeze(1)
    got = attend_without_cudnn(q, k, v, mask, 0.2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2,
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a key past a query's position changes nothing for it
    k2 = k.clone()
    k2[2, :, 30:] = 100.0
    torch.testing.assert_close(attend_without_cudnn(q, k2, v, mask, 0.2)[2], got[2])


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 2, 32),
                                                (6, 2, 48), (8, 8, 16), (4, 4, 40)])
@pytest.mark.parametrize("window", [None, 37])
def test_prompt_rows_get_the_bits_of_decode_rows(heads: int, kv_heads: int, dim: int,
                                                 window: int | None) -> None:
    """The kernel's two ways to score keys (keys in lanes for tiles of several query tokens, a
    transposed reduction for one query per sequence) give the same bits: the last rows of a
    300-token prompt, prefilled in one chunk, equal the same rows fed one at a time as decode
    rows (dim 40 takes the portable dot either way)."""
    _assert_rows_alone_equal_the_chunk(heads, kv_heads, dim, window, 300, range(280, 300), 3)


def test_a_long_prompt_gets_the_bits_of_its_decode_rows() -> None:
    """A 700-token chunk (its tiles' scores pass 256 KB: one work item per KV head) against its
    last rows fed one at a time."""
    _assert_rows_alone_equal_the_chunk(9, 3, 64, None, 700, (683, 699), 4)


def _assert_rows_alone_equal_the_chunk(heads: int, kv_heads: int, dim: int, window: int | None,
                                       length: int, rows: Iterable[int], seed: int) -> None:
    """A prompt of `length` tokens prefilled in one chunk, then each of `rows` fed alone as a
    decode row over the same cache: every one the chunk's bits."""
    query, key, value, cache, md = _inputs(heads, kv_heads, dim, [length], [length], seed=seed)
    backend = CpuAttentionBackend(dim**-0.5, window)
    whole = backend.forward(query, key, value, cache, md)
    table, slots = md.block_table[0].tolist(), md.slot_mapping.tolist()
    for row in rows:
        step = build_attention_metadata([1], [row + 1], [table], [slots[row]],
                                        torch.device("cpu"))
        alone = backend.forward(query[row:row + 1], key[row:row + 1], value[row:row + 1],
                                cache, step)
        assert torch.equal(alone, whole[row:row + 1]), f"row {row}"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="flushing subnormals is x86's FTZ / DAZ")
def test_a_subnormal_weighted_value_adds_nothing() -> None:
    """One key's score is 100 above the 39 others': each of theirs gets the weight exp(-87)
    (the softmax's floor, ~1.6e-38), and times a value of 0.5 that is subnormal, which the
    kernel flushes to zero (a microcode assist per product on Intel's cores otherwise). So a
    dimension where the top key's value is 0 and every other key's is 0.5 comes out exactly 0
    (without the flush: 39 subnormal terms, ~3.2e-37), and a dimension of all 1s exactly 1."""
    dim, keys = 16, 40
    cache = torch.zeros(2, 4, BLOCK_SIZE, 1, dim)
    slots = list(range(BLOCK_SIZE, BLOCK_SIZE + keys))  # blocks 1, 2 and 3
    k_rows, v_rows = cache[0].view(-1, dim), cache[1].view(-1, dim)
    k_rows[slots, 0] = 0.0
    k_rows[slots[0], 0] = 100.0  # q = e_0 at scale 1: scores 100, then 39 zeros
    v_rows[slots, 0] = 0.5
    v_rows[slots[0], 0] = 0.0
    v_rows[slots, 1] = 1.0
    query = torch.zeros(1, 1, dim)
    query[0, 0, 0] = 1.0
    md = build_attention_metadata([1], [keys], [[1, 2, 3]], [slots[-1]], torch.device("cpu"))
    out = torch.empty_like(query)
    rows = (torch.tensor([0]), torch.tensor([1]), torch.tensor([keys]))
    torch.ops.eaglebatch.paged_attention(query, cache, out, *rows, md.block_table, 1.0, 0)
    assert out[0, 0, 0].item() == 0.0
    assert out[0, 0, 1].item() == 1.0
