"""Cost of one EAGLE draft step relative to one target decode step, for 1, 2 and 4 draft layers.

Builds the default model and random-weight drafters of its shape (acceptance is irrelevant here),
then times, interleaved in one process: a target forward over one token per request, and one
later draft step (one token per request through every draft layer plus the draft head).

    PYTHONPATH=. python benchmarks/draft_step_cost.py --batch-sizes 1,16 --layers 1,2,4
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

from runtime.attention import build_attention_metadata
from runtime.config import DEFAULT_MODEL, EngineConfig
from runtime.engine import Engine
from runtime.kv.cache import compute_slot_mapping
from runtime.loader import resolve_model
from tests.drafter_fixtures import make_random_drafter

CONTEXT = 128  # tokens already in the cache per request


def decode_metadata(engine: Engine, batch: int) -> tuple[object, list[list[int]]]:
    bs = engine.placement.block_size
    blocks_per_seq = CONTEXT // bs + 2
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(batch)]
    slots = [compute_slot_mapping(t, [CONTEXT], bs)[0] for t in tables]
    md = build_attention_metadata([1] * batch, [CONTEXT + 1] * batch, tables, slots,
                                  engine.placement.device)
    return md, tables


def time_it(fn: object, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t)
    return out


def measure(engine: Engine, batch: int, repeats: int) -> tuple[float, float]:
    """Median ms of one target decode step and one draft step for `batch` sequences."""
    proposer = engine.proposer
    assert proposer is not None
    md, _ = decode_metadata(engine, batch)
    ids = torch.randint(0, 1000, (batch,))
    pos = torch.full((batch,), CONTEXT)
    target_md = {name: md for name in engine.model.layer_names}
    hidden = torch.randn(batch, engine.hf_config.hidden_size)

    @torch.inference_mode()
    def target_step() -> None:
        h, _ = engine.model(ids, pos, engine.runner.kv_caches, target_md)
        engine.model.compute_logits(h).argmax(-1)

    @torch.inference_mode()
    def draft_step() -> None:
        md.derived.clear()
        out = proposer.drafter(ids, pos, hidden, proposer.kv_caches, proposer.step_metadata(md))
        proposer.drafter.compute_draft_tokens(out)

    target_step(), draft_step()  # warm-up
    t_times, d_times = [], []
    for _ in range(repeats):  # interleaved so drift hits both alike
        t_times += time_it(target_step, 1)
        d_times += time_it(draft_step, 1)
    return statistics.median(t_times) * 1e3, statistics.median(d_times) * 1e3


@click.command()
@click.option("--batch-sizes", default="1,16", help="Requests per step, comma-separated.")
@click.option("--layers", default="1,2,4", help="Draft layer counts, comma-separated.")
@click.option("--style", default="eagle1", type=click.Choice(["eagle1", "eagle3"]))
@click.option("--draft-vocab-size", default=None, type=int,
              help="Own draft head of this many tokens (default: the target's LM head).")
@click.option("--repeats", default=20, help="Timed repetitions per measurement.")
@click.option("--threads", default=None, type=int, help="torch threads (default: torch's).")
def main(batch_sizes: str, layers: str, style: str, draft_vocab_size: int | None, repeats: int,
         threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    target_dir = resolve_model(DEFAULT_MODEL)
    tmp = Path(tempfile.mkdtemp(prefix="draft-cost-"))
    print("| draft layers | batch | target step ms | draft step ms | draft / target |")
    print("| --- | --- | --- | --- | --- |")
    for n in [int(x) for x in layers.split(",")]:
        extra = {"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}
        drafter = make_random_drafter(target_dir, tmp / f"d{n}", num_layers=n, style=style,
                                      **extra)  # type: ignore[arg-type]
        engine = Engine(EngineConfig(drafter=str(drafter), kv_cache_memory=1 << 30,
                                     enable_prefix_caching=False))
        for batch in [int(x) for x in batch_sizes.split(",")]:
            t_ms, d_ms = measure(engine, batch, repeats)
            print(f"| {n} | {batch} | {t_ms:.1f} | {d_ms:.1f} | {d_ms / t_ms:.2f} |", flush=True)
        del engine


if __name__ == "__main__":
    main()
