"""Decode steps through the static buffers of runtime.cuda_graphs: padded to buckets of rows and
KV blocks, with the attention plan built from tensors. On the CPU the buffers run eagerly
(capture=False), which checks everything but the capture itself: the same tokens as the plain
engine, and which steps take the path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.cuda_graphs import DecodeGraphs, bucket
from runtime.engine import Engine
from runtime.inputs import StepInputs
from runtime.request import Completion, GenerationRequest

BLOCK_SIZE = 4
LENGTHS = [3, 9, 5, 14, 7, 2]  # prompts of 1 to 4 blocks
MAX_TOKENS = [11, 5, 8, 13, 6, 9]  # requests end at different steps: batches of 1 to 4


def _engine(model_dir: Path, target: Engine | None = None, **options: object) -> Engine:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                          attention_backend="torch", block_size=BLOCK_SIZE, max_num_seqs=3,
                          kv_cache_memory=1 << 22, enable_prefix_caching=False,
                          **options)  # type: ignore[arg-type]
    engine = Engine(config, None if target is None else target.model)
    for layer in engine.model.model.layers:  # the modules and the torch backend, as on CUDA
        layer.cpu_plan = None  # type: ignore[assignment]
    return engine


def _tokens(engine: Engine) -> dict[str, tuple[int, ...]]:
    return {c.request_id: c.token_ids for c in _completions(engine)}


def _completions(engine: Engine) -> list[Completion]:
    generator = torch.Generator().manual_seed(5)
    requests = [GenerationRequest(f"r{i}", tuple(torch.randint(4, 256, (n,),
                                                               generator=generator).tolist()),
                                  SamplingParams(max_tokens=m, ignore_eos=True))
                for i, (n, m) in enumerate(zip(LENGTHS, MAX_TOKENS, strict=True))]
    return list(engine.generate(requests))


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_padded_decode_steps_give_the_plain_engines_tokens(tiny_model_dir: Path) -> None:
    plain = _engine(tiny_model_dir)
    want = _tokens(plain)
    padded = _engine(tiny_model_dir, target=plain)
    runner = padded.runner
    graphs = DecodeGraphs(padded.model, runner.kv_caches, BLOCK_SIZE, 3,
                          padded.max_model_len // BLOCK_SIZE, capture=False)
    runner.graphs = graphs
    taken: list[tuple[int, int]] = []
    run = graphs.run

    def counting_run(step: StepInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        taken.append((step.metadata.num_seqs, step.metadata.max_seq_len))
        return run(step)

    graphs.run = counting_run  # type: ignore[method-assign]
    assert _tokens(padded) == want
    # 16 of the run's steps were pure decode steps and took the buckets (the others fed a
    # prompt); 3 requests were padded to 4 rows, and 9..26 cached tokens to 4 or 8 blocks
    assert len(taken) == 16
    assert sorted({rows for rows, _ in taken}) == [1, 2, 3]
    assert sorted(graphs.buckets) == [(1, 4), (2, 8), (4, 4), (4, 8)]


def test_cuda_graphs_need_cuda(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        _engine(tiny_model_dir, cuda_graphs=True)


def test_a_drafting_engine_replays_the_steps_where_it_does_not_draft(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """With --draft-max-batch 2, steps of 3 requests do not draft: they take the buckets, and
    the drafter later reads the features those steps kept (copies of the static outputs), the
    same as without them."""
    from pipeline.bench.presets import make_random_drafter

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter", torch.float32)
    plain = _engine(tiny_model_dir)
    want = _tokens(plain)
    options = {"drafter": str(drafter), "num_speculative_tokens": 2, "draft_max_batch": 2}
    eager = {c.request_id: (c.num_drafted, c.num_accepted)
             for c in _completions(_engine(tiny_model_dir, target=plain, **options))}
    spec = _engine(tiny_model_dir, target=plain, **options)
    spec.runner.graphs = graphs = DecodeGraphs(spec.model, spec.runner.kv_caches, BLOCK_SIZE, 3,
                                               spec.max_model_len // BLOCK_SIZE, capture=False)
    completions = _completions(spec)
    assert {c.request_id: c.token_ids for c in completions} == want
    assert sum(c.num_drafted for c in completions) == 10  # requests in pairs or alone drafted
    # the same drafts as without the buckets: the drafter read the same target features
    assert {c.request_id: (c.num_drafted, c.num_accepted) for c in completions} == eager
    # steps of 3 requests (padded to 4 rows) and a pair's or a lone request's first step (no
    # drafts to verify yet) were plain decode steps
    assert sorted(graphs.buckets) == [(1, 4), (2, 8), (4, 4), (4, 8)]
