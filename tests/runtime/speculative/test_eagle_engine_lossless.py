"""EAGLE in the engine: greedy output equals the target's alone (random drafters of either style,
preemption, a t2d map, a head of its own, the C++ layer stack, a cache too small for drafts);
a seeded sample is the same with or without drafts; one metadata per draft step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_kernels import load_cpu_kernels
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from runtime.speculative.loader import DrafterMismatchError
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import make_tiny_checkpoint

PROMPT_LENGTHS = (5, 13, 1, 20, 8, 22)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 250, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def run(model_dir: Path, prompts: list[list[int]], **engine_kw: object
        ) -> tuple[Engine, dict[str, Completion]]:
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, **engine_kw))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
    return engine, {c.request_id: c for c in engine.generate(requests)}


@pytest.fixture(scope="module")
def baseline(tiny_model_dir: Path, prompts: list[list[int]]) -> dict[str, Completion]:
    return run(tiny_model_dir, prompts, kv_cache_memory=1 << 20)[1]


@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
@pytest.mark.parametrize("num_layers", [1, 2, 4])
def test_greedy_with_random_drafter_equals_target_alone_under_preemption(
        tiny_model_dir: Path, prompts: list[list[int]], baseline: dict[str, Completion],
        tmp_path: Path, style: str, num_layers: int) -> None:
    extra = {"draft_vocab_size": 100, "aux_layer_ids": (0, 1, 1)} if style == "eagle3" else {}
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter", num_layers=num_layers,
                                  style=style, seed=num_layers, **extra)  # type: ignore[arg-type]
    # ~13-26 usable blocks of 4 tokens for 6 requests of up to 46 tokens: preemption is forced
    engine, out = run(tiny_model_dir, prompts, kv_cache_memory=80_000, drafter=str(drafter),
                      max_num_batched_tokens=32)
    assert engine.scheduler.num_preemptions > 0
    assert {k: c.token_ids for k, c in out.items()} == {k: c.token_ids for k, c in baseline.items()}
    assert all(c.finish_reason == "length" for c in out.values())
    assert sum(c.num_drafted for c in out.values()) > 0
    for c in out.values():
        assert c.num_accepted <= c.num_drafted <= 3 * c.num_draft_steps
        assert sum(c.accepted_per_position) == c.num_accepted


def test_an_eagle3_checkpoint_with_t2d_and_no_d2t_drafts_as_with_its_d2t(
        tiny_model_dir: Path, prompts: list[list[int]], baseline: dict[str, Completion],
        tmp_path: Path) -> None:
    """t2d marks the draft vocabulary's target ids; the loader derives d2t from it."""
    from safetensors.torch import load_file, save_file

    with_d2t = make_random_drafter(tiny_model_dir, tmp_path / "d2t", num_layers=2,
                                   style="eagle3", draft_vocab_size=40, aux_layer_ids=(0, 1, 1))
    tensors = load_file(str(with_d2t / "model.safetensors"))
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[torch.arange(40) + tensors["d2t"]] = True
    only_t2d = tmp_path / "t2d"
    only_t2d.mkdir()
    (only_t2d / "config.json").write_text((with_d2t / "config.json").read_text())
    save_file({**{k: v for k, v in tensors.items() if k != "d2t"}, "t2d": t2d},
              str(only_t2d / "model.safetensors"))
    outs = [run(tiny_model_dir, prompts, kv_cache_memory=1 << 20, drafter=str(d))[1]
            for d in (with_d2t, only_t2d)]
    for out in outs:
        assert {k: c.token_ids for k, c in out.items()} == \
            {k: c.token_ids for k, c in baseline.items()}
    drafted = [[(c.num_drafted, c.num_accepted) for c in out.values()] for out in outs]
    assert drafted[0] == drafted[1] and sum(a for _, a in drafted[0]) > 0

    t2d[(~t2d).nonzero()[0]] = True  # 41 marked
    save_file({**{k: v for k, v in tensors.items() if k != "d2t"}, "t2d": t2d},
              str(only_t2d / "model.safetensors"))
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(only_t2d)))
    assert str(err.value) == (f"drafter {only_t2d}: t2d marks 41 target tokens but "
                              "lm_head.weight has 40 rows (one per draft token); d2t, which the "
                              "checkpoint lacks, cannot be derived")

    # a map (each target id's draft id, -1 elsewhere) must name each draft id 0..39 once
    targets = torch.arange(40) + tensors["d2t"]
    for draft_ids, shown in ((torch.arange(40) + 1000, "1000..1039"),
                             (torch.arange(40) // 2, "0..19")):
        mapped = torch.full((256,), -1, dtype=torch.int64)
        mapped[targets] = draft_ids
        save_file({**{k: v for k, v in tensors.items() if k != "d2t"}, "t2d": mapped},
                  str(only_t2d / "model.safetensors"))
        with pytest.raises(DrafterMismatchError) as err:
            Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                kv_cache_memory=1 << 20, drafter=str(only_t2d)))
        assert str(err.value) == (f"drafter {only_t2d}: t2d maps 40 target tokens to draft ids "
                                  f"{shown}, not to each of 0..39 once; d2t, which the "
                                  "checkpoint lacks, cannot be derived")


def test_every_draft_layer_gets_the_same_metadata_object_each_step(
        tiny_model_dir: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "three", num_layers=3)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=str(drafter), num_speculative_tokens=3))
    assert engine.proposer is not None
    layers = engine.proposer.drafter.layers
    assert [layer.self_attn.layer_name for layer in layers] == ["layers.2", "layers.3", "layers.4"]
    seen: list[list[object]] = [[] for _ in layers]

    def recorder(i: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple) -> None:
            seen[i].append(args[4])  # Attention.forward(x, positions, rope, kv_cache, md)
        return hook

    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(recorder(i))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    list(engine.generate([GenerationRequest("a", tuple(prompts[0]), params),
                          GenerationRequest("b", tuple(prompts[1]), params)]))
    # per engine step that samples: 1 first draft step + (k - 1) later ones
    assert len(seen[0]) >= 3 * 2
    assert len(seen[0]) == len(seen[1]) == len(seen[2])
    for step, md in enumerate(seen[0]):
        assert seen[1][step] is md and seen[2][step] is md
    assert len({id(md) for md in seen[0]}) == len(seen[0])  # a new object every draft step
    # step 1 covers every verified position, later steps one token per request
    assert seen[0][0].query_lens == [len(prompts[0]), len(prompts[1])]
    assert seen[0][1].query_lens == [1, 1] and seen[0][2].query_lens == [1, 1]


@pytest.mark.parametrize("with_norm", [True, False])
def test_eagle1_checkpoint_with_its_own_small_head_is_lossless(
        tiny_model_dir: Path, prompts: list[list[int]], baseline: dict[str, Completion],
        tmp_path: Path, with_norm: bool) -> None:
    from safetensors.torch import load_file, save_file

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "own-head", num_layers=2)
    tensors = {f"model.{k}": v for k, v in load_file(str(drafter / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(5)
    vocab = torch.randperm(256, generator=g)[:40].sort().values
    tensors["lm_head.weight"] = torch.randn(40, 64, generator=g)
    tensors["d2t"] = vocab - torch.arange(40)
    if with_norm:
        tensors["norm.weight"] = torch.ones(64)
    save_file(tensors, str(drafter / "model.safetensors"))
    engine, out = run(tiny_model_dir, prompts, kv_cache_memory=1 << 20, drafter=str(drafter))
    assert engine.proposer is not None and engine.proposer.drafter.own_head
    assert {k: c.token_ids for k, c in out.items()} == {k: c.token_ids for k, c in baseline.items()}
    # every draft token comes from the 40-token draft vocabulary
    assert sum(c.num_drafted for c in out.values()) > 0


def test_engine_is_reusable_after_the_caller_stops_early(
        tiny_model_dir: Path, prompts: list[list[int]], baseline: dict[str, Completion]) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
    stream = engine.generate(requests)
    next(stream)
    stream.close()  # abandon the rest mid-flight
    assert engine.scheduler.num_unfinished == 0
    assert engine.kv.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    again = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert again == {k: c.token_ids for k, c in baseline.items()}


def _counting(run_stack: Callable[..., list[torch.Tensor] | None], runs: list[int]
              ) -> Callable[..., list[torch.Tensor] | None]:
    """run_stack, counting in runs[0] the calls it did not decline."""
    def counted(*args: object, **kw: object) -> list[torch.Tensor] | None:
        out = run_stack(*args, **kw)
        runs[0] += out is not None
        return out
    return counted


@pytest.mark.parametrize("heads", [{}, {"num_attention_heads": 8, "num_key_value_heads": 4,
                                       "head_dim": 32}], ids=["target's heads", "other heads"])
@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_drafter_layer_stack_gives_its_layers_bits(
        style: str, heads: dict[str, int], prompts: list[list[int]], tmp_path: Path) -> None:
    """On widths in whole panels the drafter's layers run as one C++ call
    (runtime.cpu_layer.CpuLayerStack), EAGLE-1's first layer without its input norm and
    EAGLE-3's on 2H inputs included: every draft step's hidden states are the bits of its
    layers run one by one, and the tokens are the target's. A drafter's head counts need not be
    its target's (4 heads of 32, 2 KV heads; here 8 and 4, of 32): its layers then have a KV
    cache group of their own, over the same block table."""
    assert load_cpu_kernels(), "the CPU kernels did not build (see the warning)"
    model = make_tiny_checkpoint(tmp_path / "model", hidden_size=128, num_heads=4,
                                 num_kv_heads=2, intermediate_size=128)
    drafter = make_random_drafter(model, tmp_path / "drafter", num_layers=2, style=style,
                                  aux_layer_ids=(0, 1, 1) if style == "eagle3" else None,
                                  **heads)
    hidden: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    tokens = {}
    for stacked in (True, False):
        engine = Engine(EngineConfig(model=str(model), block_size=4, kv_cache_memory=1 << 20,
                                     drafter=str(drafter), num_speculative_tokens=3,
                                     dtype="float32"))
        assert engine.proposer is not None
        groups = engine.kv_cache_config.groups
        assert [g.layer_names[-2:] for g in groups] == (
            [("layers.2", "layers.3")] if not heads else [("layers.0", "layers.1"),
                                                          ("layers.2", "layers.3")])
        draft_model = engine.proposer.drafter
        stack = draft_model.cpu_stack
        assert stack is not None
        if not stacked:
            draft_model.cpu_stack = None
        runs = [0]
        stack.run = _counting(stack.run, runs)  # type: ignore[method-assign]
        draft_model.register_forward_hook(
            lambda module, args, out, seen=hidden[stacked]: seen.append(out.clone()))
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        done = engine.generate(GenerationRequest(str(i), tuple(p), params)
                               for i, p in enumerate(prompts))
        tokens[stacked] = {c.request_id: c.token_ids for c in done}
        if stacked:  # every draft step ran in it, prompt chunks included
            assert runs[0] == len(hidden[True])
        else:
            assert runs[0] == 0
    assert len(hidden[True]) == len(hidden[False]) > 2 * len(prompts)
    assert all(torch.equal(a, b) for a, b in zip(hidden[True], hidden[False], strict=True))
    baseline = run(model, prompts, kv_cache_memory=1 << 20, dtype="float32")[1]
    assert tokens[True] == tokens[False] == {k: c.token_ids for k, c in baseline.items()}


def test_a_seeded_sample_is_the_same_with_or_without_drafts_whatever_the_batch(
        tiny_model_dir: Path, prompts: list[list[int]], tmp_path: Path) -> None:
    """Each token is drawn from its own uniform (seed, token index): drafts, the token budget
    cutting them, and preemptions change how tokens are found, never which."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)
    requests = [GenerationRequest(str(i), tuple(p), SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True))
        for i, p in enumerate(prompts)]

    def run(**engine_kw: object) -> tuple[Engine, dict[str, tuple[int, ...]]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, **engine_kw))  # type: ignore[arg-type]
        return engine, {c.request_id: tuple(c.token_ids) for c in engine.generate(requests)}

    _, plain = run(kv_cache_memory=1 << 20)
    _, alone = run(kv_cache_memory=1 << 20, max_num_seqs=1)
    assert alone == plain
    drafted = dict(drafter=str(drafter), num_speculative_tokens=3, draft_confidence=0.0)
    for engine_kw in ({"kv_cache_memory": 1 << 20},
                      {"kv_cache_memory": 1 << 20, "max_num_batched_tokens": 5},
                      {"kv_cache_memory": 24 * 4096}):  # 24 blocks of 4 tokens for 4 layers
        engine, out = run(**drafted, **engine_kw)
        assert out == plain, engine_kw
        if engine_kw["kv_cache_memory"] < 1 << 20:
            assert engine.scheduler.num_preemptions > 0
    assert len({toks for toks in plain.values()}) == len(prompts)


def test_a_request_alone_at_the_edge_of_the_cache_finishes_without_drafts(
        tiny_model_dir: Path, prompts: list[list[int]], baseline: dict[str, Completion],
        tmp_path: Path) -> None:
    """A cache that holds the longest request's tokens (22 + 24 - 1 = 45 slots: 12 blocks of 4)
    but not, in its last steps, the 4 slots the drafter writes ahead (45 + 4 > 48): the request
    drafts while there is room and runs its last steps without drafts, instead of failing for
    want of a cache that plain decoding does not need; the other requests too (preempted, then
    alone in turn)."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter", num_layers=1,
                                  style="eagle1", seed=5)
    block_bytes = 3 * 2 * 4 * 2 * 16 * 4  # 3 layers (2 target, 1 drafter), K and V, 4 slots
    engine, out = run(tiny_model_dir, prompts, kv_cache_memory=13 * block_bytes,
                      drafter=str(drafter), num_speculative_tokens=4)
    assert engine.kv_cache_config.num_blocks == 13  # 12 usable, block 0 is the null block
    assert {k: c.token_ids for k, c in out.items()} == {k: c.token_ids for k, c in baseline.items()}
    assert all(c.finish_reason == "length" and c.error is None for c in out.values())
    longest = out[str(PROMPT_LENGTHS.index(22))]
    assert 0 < longest.num_draft_steps
    assert engine.scheduler.num_preemptions > 0
    # a prompt that fits only without the slots written ahead (45 + 4 > 48) is admitted so
    long_prompt = GenerationRequest("long", tuple(range(4, 49)),
                                    SamplingParams(max_tokens=3, ignore_eos=True))
    plain = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                kv_cache_memory=1 << 20))
    [want] = plain.generate([long_prompt])
    [got] = engine.generate([long_prompt])
    assert got.error is None and got.token_ids == want.token_ids and len(want.token_ids) == 3
