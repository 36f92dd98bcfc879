"""EAGLE in the engine: lossless greedy output, the one-group check, one metadata per draft step."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.cpu_kernels import load_cpu_kernels
from runtime.engine import Engine
from runtime.kv.groups import KVCacheGroupError
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


def test_drafter_with_sliding_window_layers_fails_group_check_naming_layers(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = make_random_drafter(
        tiny_model_dir, tmp_path / "mixed", num_layers=3, style="eagle1", sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"])
    with pytest.raises(KVCacheGroupError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    message = str(err.value)
    for name in ("layers.2", "layers.3", "layers.4"):
        assert name in message
    assert "sliding_window=8" in message


def test_a_qwen2_style_drafter_config_gets_windows_from_max_window_layers(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Without layer_types, a config's max_window_layers says which layers have windows (from
    that layer up), as transformers' Qwen2Config reads it: mixed layers fail the group check,
    and a one-layer drafter below max_window_layers (copied from a 28-layer target) has none."""
    qwen2_style = {"use_sliding_window": True, "sliding_window": 8}
    mixed = make_random_drafter(tiny_model_dir, tmp_path / "mixed", num_layers=2,
                                max_window_layers=1, **qwen2_style)
    assert "layer_types" not in json.loads((mixed / "config.json").read_text())
    with pytest.raises(KVCacheGroupError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(mixed)))
    assert "sliding_window=8" in str(err.value)
    below = make_random_drafter(tiny_model_dir, tmp_path / "below", num_layers=1,
                                max_window_layers=28, **qwen2_style)
    above = make_random_drafter(tiny_model_dir, tmp_path / "above", num_layers=1,
                                max_window_layers=0, **qwen2_style)
    for drafter, window in ((below, None), (above, 8)):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     kv_cache_memory=1 << 20, drafter=str(drafter),
                                     max_model_len=64))
        assert engine.proposer is not None
        layers = engine.proposer.drafter.layers
        assert [layer.self_attn.backend.sliding_window for layer in layers] == [window]


@pytest.mark.parametrize("shift, first", [(-1000, 5), (10_000, 7)])
def test_a_d2t_that_maps_outside_the_target_vocabulary_is_refused_at_load(
        tiny_model_dir: Path, tmp_path: Path, shift: int, first: int) -> None:
    """Caught when the drafter loads, not hours into a job when it first drafts that token."""
    from safetensors.torch import load_file, save_file

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d2t", num_layers=1,
                                  style="eagle3", draft_vocab_size=40)
    tensors = load_file(str(drafter / "model.safetensors"))
    tensors["d2t"][first] += shift
    tensors["d2t"][first + 3] += shift
    save_file(tensors, str(drafter / "model.safetensors"))
    mapped = first + int(tensors["d2t"][first])
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    assert str(err.value) == (f"drafter {drafter}: d2t maps draft token {first} to target token "
                              f"{mapped}, outside the target's vocabulary of 256 (2 draft "
                              "token(s) map outside it)")


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


def test_a_d2t_of_another_length_than_the_draft_head_is_refused(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "short", num_layers=1,
                                  style="eagle3", draft_vocab_size=40)
    tensors = load_file(str(drafter / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"][:39].clone()
    save_file(tensors, str(drafter / "model.safetensors"))
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    assert str(err.value) == (f"drafter {drafter}: d2t has shape (39,) but lm_head.weight has 40 "
                              "rows (expected one d2t entry per draft token)")


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


def test_drafter_that_does_not_fit_names_the_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_checkpoint(tmp_path / "wide", hidden_size=96, num_heads=6, num_kv_heads=2)
    drafter = make_random_drafter(other, tmp_path / "wide-drafter", num_layers=1)
    with pytest.raises(DrafterMismatchError, match="hidden_size is 96 in the drafter but 64"):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    # heads of another size (the target's 4 heads are of 16); other head counts do fit
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "head-dim", num_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {drafter} does not fit the target: head_dim is 32 in the drafter but 16 in "
            "the target")):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))


def test_drafter_with_a_damaged_weights_file_names_the_file(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "damaged", num_layers=1)
    weights = next(drafter.glob("*.safetensors"))
    weights.write_bytes(b"\x08" + b"\0" * 7 + b"garbage!")
    with pytest.raises(DrafterMismatchError, match=f"drafter {drafter}: cannot read "
                                                   f"{weights.name} \\("):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))


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


@pytest.mark.parametrize(("earlier", "hit_tokens"), [((90, 91, 92), 8), ((40, 91, 92), 12)])
def test_a_prefix_hit_drafts_as_a_fresh_engine_does(
        tiny_model_dir: Path, tmp_path: Path, earlier: tuple[int, ...], hit_tokens: int) -> None:
    """The drafter's KV at a hit's last position pairs it with the token after the hit: an
    earlier request with another token there must not lend it its KV (the hit ends a block
    sooner), one with the same token may."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three blocks of 4
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(engine: Engine, request: GenerationRequest
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The drafts `request` got, and its drafter KV at the prefix's last position after
        its first step."""
        proposer = engine.runner.proposer
        assert proposer is not None
        propose, drafts, kv = proposer.propose, [], []

        def recording(step, out, *args):  # noqa: ANN001, ANN202
            proposed = propose(step, out, *args)
            for s, d in zip(out.scheduled, proposed, strict=True):
                if s.seq.request_id == request.request_id:
                    drafts.append(d)
                    block = engine.kv.block_ids(request.request_id)[11 // 4]
                    kv.extend(engine.runner.kv_caches[name][:, block, 11 % 4].clone()
                              for name in proposer.drafter.layer_names)
            return proposed

        proposer.propose = recording  # type: ignore[method-assign]
        list(engine.generate([request]))
        proposer.propose = propose  # type: ignore[method-assign]
        return drafts, kv[:2]

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False))

    x = GenerationRequest("x", tuple(prefix + [40, 41, 42]), params)
    fresh_drafts, fresh_kv = run(engine(), x)
    shared = engine()
    list(shared.generate([GenerationRequest("y", tuple(prefix + list(earlier)), params)]))
    before = shared.kv.hits_tokens
    drafts, kv = run(shared, x)
    assert shared.kv.hits_tokens - before == hit_tokens
    assert all(torch.equal(a, b) for a, b in zip(kv, fresh_kv, strict=True))
    assert drafts == fresh_drafts


def _drafts_of(engine: Engine, requests: list[GenerationRequest], request_id: str
               ) -> tuple[list[list[int]], dict[str, Completion]]:
    """Runs `requests`; the drafts proposed to `request_id` in each step, and the completions."""
    proposer = engine.runner.proposer
    assert proposer is not None
    propose, drafts = proposer.propose, []

    def recording(step, out, *args):  # noqa: ANN001, ANN202
        proposed = propose(step, out, *args)
        drafts.extend(d for s, d in zip(out.scheduled, proposed, strict=True)
                      if s.seq.request_id == request_id)
        return proposed

    proposer.propose = recording  # type: ignore[method-assign]
    done = {c.request_id: c for c in engine.generate(requests)}
    proposer.propose = propose  # type: ignore[method-assign]
    return drafts, done


def test_blocks_whose_drafter_kv_waited_for_a_drafting_step_are_not_lent(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """In steps that draft nothing (more greedy requests than draft_max_batch) the drafter's rows
    of generated tokens wait for the next step that drafts; a request that finishes (or is
    preempted) first leaves them unwritten. A later request taking its blocks from the prefix
    cache must not read that drafter KV: it drafts as a fresh engine does."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False, draft_max_batch=1))

    prompt = (11, 12, 13, 14, 15, 16)
    a = GenerationRequest("a", prompt, SamplingParams(max_tokens=14, ignore_eos=True))
    c = GenerationRequest("c", (30, 31, 32, 33, 34), SamplingParams(max_tokens=30,
                                                                    ignore_eos=True))
    shared = engine()
    done = _drafts_of(shared, [a, c], "a")[1]
    b = GenerationRequest("b", prompt + done["a"].token_ids + (40, 41),
                          SamplingParams(max_tokens=10, ignore_eos=True))
    fresh = _drafts_of(engine(), [b], "b")
    before = shared.kv.hits_tokens
    reused = _drafts_of(shared, [b], "b")
    assert shared.kv.hits_tokens - before == 4  # the prompt's first block; the rest waited
    assert reused[0] == fresh[0]
    assert reused[1]["b"].token_ids == fresh[1]["b"].token_ids


def test_drafts_do_not_depend_on_the_batch_with_preemptions(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """The drafter's KV of a request is the same whatever ran beside it, so the drafts it gets at
    a given length are the ones it gets alone, through steps that draft nothing (three greedy
    requests, draft_max_batch 1), a 3-8 token budget and preemptions that recompute it from
    blocks cached before (whose drafter rows waited in the stash)."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine(**kw: int) -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=False, draft_max_batch=1, **kw))  # type: ignore[arg-type]

    def drafts_by_length(engine: Engine, requests: list[GenerationRequest]
                         ) -> dict[tuple[str, int], list[int]]:
        """(request id, its length once this step's tokens are in) -> the drafts it got."""
        proposer = engine.runner.proposer
        assert proposer is not None
        propose, seen = proposer.propose, {}

        def recording(step, out, features, emitted, verified):  # noqa: ANN001, ANN202
            proposed = propose(step, out, features, emitted, verified)
            for s, d, e in zip(out.scheduled, proposed, emitted, strict=True):
                if e is not None and d:
                    seen[(s.seq.request_id, len(s.seq.token_ids) + len(e))] = d
            return proposed

        proposer.propose = recording  # type: ignore[method-assign]
        list(engine.generate(requests))
        return seen

    g = torch.Generator().manual_seed(1)
    compared = preemptions = 0
    alone = engine(kv_cache_memory=1 << 20)  # one request at a time, prompts unlike each other
    for _ in range(4):
        lengths = torch.randint(2, 20, (3,), generator=g).tolist()
        max_tokens = torch.randint(4, 24, (3,), generator=g).tolist()
        prompts = [tuple(torch.randint(4, 250, (n,), generator=g).tolist()) for n in lengths]
        requests = [GenerationRequest(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        batched = engine(max_num_batched_tokens=int(torch.randint(3, 9, (1,), generator=g)),
                         kv_cache_memory=60_000)
        together = drafts_by_length(batched, requests)
        preemptions += batched.scheduler.num_preemptions
        for request in requests:
            own = drafts_by_length(alone, [request])
            common = [key for key in together if key in own]
            assert [together[key] for key in common] == [own[key] for key in common]
            compared += len(common)
    assert preemptions >= 2 and compared >= 15


def test_a_running_requests_blocks_whose_drafter_rows_wait_are_not_lent(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Steps where every request drafts from its n-gram lookup do not run the drafter either, so
    a running request's generated rows wait while its blocks are already cached; a request
    admitted meanwhile that extends its text must not take those blocks' drafter KV."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)

    def engine(**kw: bool) -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                   kv_cache_memory=1 << 20, drafter=str(drafter),
                                   num_speculative_tokens=2, draft_confidence=0.0,
                                   draft_ngram=True, draft_max_batch=None, max_num_seqs=2,
                                   max_num_batched_tokens=8, **kw))  # type: ignore[arg-type]

    prompt = (11, 12, 13, 14, 15, 16)
    plain = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                kv_cache_memory=1 << 20))
    [first] = plain.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=40,
                                                                            ignore_eos=True))])
    w = GenerationRequest("w", prompt + first.token_ids[:8] + tuple(range(40, 50)),
                          SamplingParams(max_tokens=16, ignore_eos=True))
    requests = [GenerationRequest("p", prompt, SamplingParams(max_tokens=40, ignore_eos=True)),
                GenerationRequest("c", prompt, SamplingParams(max_tokens=10, ignore_eos=True)),
                w]
    alone = _drafts_of(engine(enable_prefix_caching=False), [w], "w")[0]
    together, done = _drafts_of(engine(), requests, "w")
    assert together[-len(alone):] == alone  # w's steps after it is admitted
    assert done["w"].token_ids == plain.generate([w]).__next__().token_ids


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
