"""Our CausalLM on the paged cache against transformers' implementation of the same checkpoint.

Each case saves a tiny random fp32 checkpoint, perturbs the weights that random init leaves
constant (norm weights = 1, qkv biases = 0) so that loading them wrongly would show, and compares
logits within 1e-4 relative error: one prefill, token-by-token decode across block boundaries,
a chunked prefill, and one forward mixing a decode, a long and a short prefill chunk. Each case
runs on the torch backend and on the cpu one (its C++ kernel takes queries of up to 16 tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from runtime.attention import build_attention_metadata
from runtime.config import EngineConfig
from runtime.cpu_kernels import load_cpu_kernels
from runtime.cpu_layer import CpuLayerPlan, CpuLayerStack
from runtime.kv.cache import compute_slot_mapping
from runtime.loader import load_model_config, load_state_dict
from runtime.model import CausalLM, head_dim_of
from runtime.setup import build_model, place
from tests.fixtures import make_tiny_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_POSITIONS = 64
REL_TOL = 1e-4
SEQ_LEN = 21  # a whole prefill spans several blocks and its own length bucket (17-32)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES: dict[str, dict[str, Any]] = {
    "llama-gqa": {"arch": "llama"},
    "qwen2-qkv-bias": {"arch": "qwen2"},
    "qwen3-qk-norm": {"arch": "qwen3"},  # head_dim 128, not hidden / heads
    "mistral": {"arch": "mistral"},
    "mistral-window8": {"arch": "mistral", "sliding_window": 8},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True},
    "llama3-rope": {"arch": "llama", "rope_scaling": LLAMA3_ROPE,
                    "max_position_embeddings": 128},
}


class Pair(NamedTuple):
    ours: CausalLM  # built directly and loaded with load_weights
    reference: PreTrainedModel
    model_dir: Path
    backend: str


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (more only adds synchronization)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[(case, backend) for case in CASES
                                        for backend in ("torch", "cpu")],
                ids=lambda param: "-".join(param))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case, backend = request.param
    if backend == "cpu":  # the C++ kernel for short queries; every CPU machine here builds it
        assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    options = dict(CASES[case])
    window = options.pop("sliding_window", None)
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(case), **options)
    _set_window(model_dir, window)
    reference = _perturbed_reference(model_dir)
    ours = CausalLM(load_model_config(model_dir), backend, MAX_POSITIONS)
    ours.load_weights(load_state_dict(model_dir, torch.float32))
    return Pair(ours.eval(), reference, model_dir, backend)


def _set_window(model_dir: Path, window: int | None) -> None:
    if window is not None:
        config_file = model_dir / "config.json"
        config = json.loads(config_file.read_text())
        config["sliding_window"] = window
        config_file.write_text(json.dumps(config))


def _perturbed_reference(model_dir: Path) -> PreTrainedModel:
    """Load the checkpoint, give norms and biases random values, and save it back."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(model_dir)
    return model.eval()


def _tokens(seed: int, n: int = SEQ_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (n,), generator=generator).tolist()


def _reference_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():  # [len(tokens), vocab]
        return model(torch.tensor([tokens])).logits[0]


class Feed(NamedTuple):
    """One sequence's part of a forward pass: tokens[start:start + num_new] at their positions."""

    tokens: list[int]
    start: int
    num_new: int
    block_table: list[int]


class PagedCache:
    def __init__(self, model: CausalLM) -> None:
        config = model.config
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim_of(config))
        self.model = model
        self.caches = {name: torch.zeros(shape) for name in model.layer_names}

    def forward(self, *feeds: Feed) -> torch.Tensor:  # [sum of num_new, vocab]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for feed in feeds:
            pos = list(range(feed.start, feed.start + feed.num_new))
            input_ids += feed.tokens[feed.start:feed.start + feed.num_new]
            positions += pos
            slots += compute_slot_mapping(feed.block_table, pos, BLOCK_SIZE)
        md = build_attention_metadata([f.num_new for f in feeds],
                                      [f.start + f.num_new for f in feeds],
                                      [f.block_table for f in feeds], slots, torch.device("cpu"))
        metadata = {name: md for name in self.model.layer_names}
        with torch.inference_mode():
            out = self.model(torch.tensor(input_ids), torch.tensor(positions), self.caches,
                             metadata)
            return self.model.compute_logits(out.hidden_states)


def _assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    error = (ours - reference).abs().max().item()
    assert error <= REL_TOL * reference.abs().max().item(), f"max abs error {error}"


# Scattered, non-contiguous block ids: positions 0..3 live in block 9, 4..7 in block 3, ...
TABLE_A = [9, 3, 17, 1, 12, 5]
TABLE_B = [2, 20, 7, 14, 6, 11]
TABLE_C = [4, 19]


def test_prefill_matches_transformers(pair: Pair) -> None:
    tokens = _tokens(0)
    logits = PagedCache(pair.ours).forward(Feed(tokens, 0, SEQ_LEN, TABLE_A))
    _assert_close(logits, _reference_logits(pair.reference, tokens))


def test_decode_one_token_at_a_time_across_blocks(pair: Pair) -> None:
    tokens = _tokens(1)
    reference = _reference_logits(pair.reference, tokens)
    cache = PagedCache(pair.ours)
    _assert_close(cache.forward(Feed(tokens, 0, 3, TABLE_A)), reference[:3])
    for position in range(3, SEQ_LEN):  # crosses the block boundaries at 4, 8, 12, 16, 20
        _assert_close(cache.forward(Feed(tokens, position, 1, TABLE_A)),
                      reference[position:position + 1])


def test_chunked_prefill_matches_transformers(pair: Pair) -> None:
    tokens = _tokens(2)
    cache = PagedCache(pair.ours)
    chunks = []
    start = 0
    for size in (5, 3, 9, 4):  # chunk ends fall mid-block
        chunks.append(cache.forward(Feed(tokens, start, size, TABLE_A)))
        start += size
    assert start == SEQ_LEN
    _assert_close(torch.cat(chunks), _reference_logits(pair.reference, tokens))


def test_mixed_batch_matches_transformers(pair: Pair) -> None:
    """One forward with a decode token (A), a prefill (B, length bucket 17-32) and a short
    prefill chunk (C, bucket 5-8): three padded batches in one pass."""
    a, b, c = _tokens(3), _tokens(4, 18), _tokens(5, 6)
    cache = PagedCache(pair.ours)
    cache.forward(Feed(a, 0, 10, TABLE_A))
    logits = cache.forward(Feed(a, 10, 1, TABLE_A), Feed(b, 0, 18, TABLE_B),
                           Feed(c, 0, 6, TABLE_C))
    _assert_close(logits[:1], _reference_logits(pair.reference, a)[10:11])
    _assert_close(logits[1:19], _reference_logits(pair.reference, b))
    _assert_close(logits[19:], _reference_logits(pair.reference, c))


def test_engine_build_path_gives_the_same_model(pair: Pair) -> None:
    """runtime.setup.build_model (meta-device construction, then load) as the engine does it."""
    placement = place(EngineConfig(model=str(pair.model_dir), device="cpu", dtype="float32",
                                   block_size=BLOCK_SIZE, attention_backend=pair.backend))
    built = build_model(pair.model_dir, load_model_config(pair.model_dir), placement,
                        MAX_POSITIONS)
    tokens = _tokens(6)
    logits = PagedCache(built).forward(Feed(tokens, 0, SEQ_LEN, TABLE_A))
    _assert_close(logits, _reference_logits(pair.reference, tokens))


def test_decode_logits_do_not_depend_on_batch_or_verification(pair: Pair) -> None:
    """After the same prefill, a request decoded alone one token at a time, and the same request fed
    4 tokens at once as a k = 3 verification next to other requests' prefill chunks and decodes,
    get equal logits: bit for bit with the cpu backend on the engine's CPU layout (panel_linear
    for every product); the torch backend's SDPA rounds by batch shape, so only close there."""
    placement = place(EngineConfig(model=str(pair.model_dir), device="cpu", dtype="float32",
                                   block_size=BLOCK_SIZE, attention_backend=pair.backend))
    model = build_model(pair.model_dir, load_model_config(pair.model_dir), placement,
                        MAX_POSITIONS)
    prompt, seq = 18, _tokens(7, 23)  # an 18-token prompt, then 5 "generated" tokens
    other, third = _tokens(8, 21), _tokens(9, 8)  # prompts of 20 and 7, one token generated
    alone = PagedCache(model)
    want = [alone.forward(Feed(seq, 0, prompt, TABLE_A))[-1:]]
    for position in range(prompt, 23):
        want.append(alone.forward(Feed(seq, position, 1, TABLE_A)))
    together = PagedCache(model)
    first = together.forward(Feed(seq, 0, prompt, TABLE_A),
                             Feed(other, 0, 20, TABLE_B))[prompt - 1:prompt]
    verified = together.forward(Feed(third, 0, 7, TABLE_C), Feed(other, 20, 1, TABLE_B),
                                Feed(seq, prompt, 4, TABLE_A))[8:]
    last = together.forward(Feed(seq, prompt + 4, 1, TABLE_A),
                            Feed(third, 7, 1, TABLE_C))[:1]
    got = torch.cat([first, verified, last])
    if pair.backend == "cpu":
        assert torch.equal(got, torch.cat(want))
    else:
        _assert_close(got, torch.cat(want))


def test_prompt_logits_do_not_depend_on_how_the_prompt_is_chunked(pair: Pair) -> None:
    """An 18-token prompt prefilled in one step, or in chunks of 5 and 13 (the second beside
    another request's prompt), or of 17 and 1: the same logits at every position, bit for bit
    with the cpu backend (its attention kernel computes every query alone); the torch
    backend's SDPA rounds by the chunk's shape, so only close there."""
    placement = place(EngineConfig(model=str(pair.model_dir), device="cpu", dtype="float32",
                                   block_size=BLOCK_SIZE, attention_backend=pair.backend))
    model = build_model(pair.model_dir, load_model_config(pair.model_dir), placement,
                        MAX_POSITIONS)
    seq, other = _tokens(13, 18), _tokens(14, 20)
    want = PagedCache(model).forward(Feed(seq, 0, 18, TABLE_A))
    for first in (5, 17):
        cache = PagedCache(model)
        head = cache.forward(Feed(seq, 0, first, TABLE_A))
        tail = cache.forward(Feed(other, 0, 20, TABLE_B), Feed(seq, first, 18 - first, TABLE_A))
        got = torch.cat([head, tail[20:]])
        if pair.backend == "cpu":
            assert torch.equal(got, want), first
        else:
            _assert_close(got, want)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_layer_plans_give_the_modules_bits(case: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With widths in whole panels (q/k/v and gate/up fused) every layer gets a CpuLayerPlan
    (runtime.cpu_layer) on the engine's CPU layout, and the model a CpuLayerStack of them;
    prefill, decode and a verification next to other requests give the same bits with the
    stack (every step here), with the plans layer by layer, and through the modules, and stay
    close to transformers."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    options = dict(CASES[case])
    window = options.pop("sliding_window", None)
    model_dir = make_tiny_checkpoint(tmp_path, hidden_size=128, num_heads=4, num_kv_heads=2,
                                     intermediate_size=128, **options)
    _set_window(model_dir, window)
    reference = _perturbed_reference(model_dir)
    placement = place(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                   block_size=BLOCK_SIZE, attention_backend="cpu"))
    model = build_model(model_dir, load_model_config(model_dir), placement, MAX_POSITIONS)
    layers = list(model.model.layers)
    plans = [layer.cpu_plan for layer in layers]
    assert all(plan is not None for plan in plans)
    assert model.cpu_stack is not None
    seq, other, third = _tokens(10, 23), _tokens(11, 21), _tokens(12, 7)
    calls = {"plan": 0, "stack": 0}
    plan_call, stack_run = CpuLayerPlan.__call__, CpuLayerStack.run

    def counted(self: CpuLayerPlan, *args: Any) -> torch.Tensor:
        calls["plan"] += 1
        return plan_call(self, *args)

    def counted_stack(self: CpuLayerStack, *args: Any) -> list[torch.Tensor] | None:
        out = stack_run(self, *args)
        calls["stack"] += out is not None
        return out

    monkeypatch.setattr(CpuLayerPlan, "__call__", counted)
    monkeypatch.setattr(CpuLayerStack, "run", counted_stack)

    def run() -> torch.Tensor:
        cache = PagedCache(model)
        prefill = cache.forward(Feed(seq, 0, 18, TABLE_A), Feed(other, 0, 20, TABLE_B))
        decode = cache.forward(Feed(other, 20, 1, TABLE_B))
        verify = cache.forward(Feed(third, 0, 7, TABLE_C), Feed(seq, 18, 4, TABLE_A))
        return torch.cat([prefill, decode, verify])

    stacked = run()
    # prefill (rows of 18 and 20 queries), decode and verification: one call of the stack each
    assert calls == {"plan": 0, "stack": 3}
    stack, model.cpu_stack = model.cpu_stack, None
    planned = run()
    assert calls == {"plan": 3 * len(layers), "stack": 3}
    for layer in layers:
        layer.cpu_plan = None
    modules = run()
    assert calls == {"plan": 3 * len(layers), "stack": 3}
    assert torch.equal(stacked, planned)
    assert torch.equal(planned, modules)
    model.cpu_stack = stack
    _assert_close(planned[:18], _reference_logits(reference, seq[:18]))
