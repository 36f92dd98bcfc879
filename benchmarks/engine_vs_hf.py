"""Engine tokens/s against transformers `generate` with static batches, on the same prompts.

Both sides run the same model in float32 on the CPU, greedy, with EOS ignored so every prompt
gets exactly --max-tokens new tokens (equal work). The engine runs continuous batching with
max_num_seqs = B; transformers runs the prompts in order, B at a time, left-padded.

    python benchmarks/engine_vs_hf.py                       # 64 prompts, 128 tokens, B = 16, 64
    python benchmarks/engine_vs_hf.py --num-prompts 8 --max-tokens 16 --batch-sizes 4

On a machine shared with other jobs, --threads 1 gives steadier (and often faster) numbers:
idle-waiting torch threads then cost nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from runtime.config import DEFAULT_MODEL, EngineConfig, SamplingParams, parse_memory_size
from runtime.engine import Engine
from runtime.loader import resolve_model
from runtime.request import GenerationRequest

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "examples" / "prompts.parquet"
FALLBACK_PROMPTS = (
    "What is the capital of France?",
    "Explain how a hash map works and when you would not use one.",
    "Write a haiku about autumn rain.",
    "Summarize the causes of the French Revolution in a short paragraph for a high school "
    "student, and mention one book they could read to learn more.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Why is the sky blue?",
    "Give three tips for writing a clear bug report.",
    "Compare TCP and UDP, with one example application for each, in a few sentences.",
)


def load_prompts(num_prompts: int) -> list[str]:
    """num_prompts prompts spread evenly over examples/prompts.parquet (or the fallback list)."""
    if PROMPTS_FILE.is_file():
        import pyarrow.parquet as pq  # noqa: PLC0415  (only the benchmark reads Parquet)

        texts = pq.read_table(PROMPTS_FILE, columns=["prompt"]).column("prompt").to_pylist()
    else:
        texts = list(FALLBACK_PROMPTS)
    return [texts[i * len(texts) // num_prompts % len(texts)] for i in range(num_prompts)]


def tokenize(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    ids = []
    for text in prompts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer(chat, add_special_tokens=False).input_ids)
    return ids


def run_engine(model_dir: Path, prompts: list[list[int]], max_tokens: int, batch_size: int,
               kv_cache_memory: int | None, honour_eos: bool) -> tuple[int, float]:
    """(generated tokens, seconds) for all prompts through one engine with max_num_seqs=B."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 max_num_seqs=batch_size, kv_cache_memory=kv_cache_memory))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=not honour_eos)
    warmup = [GenerationRequest("warmup", tuple(prompts[0]), SamplingParams(max_tokens=4))]
    list(engine.generate(warmup))
    requests = (GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts))
    start = time.perf_counter()
    tokens = sum(len(c.token_ids) for c in engine.generate(requests))
    return tokens, time.perf_counter() - start


def run_transformers(model: torch.nn.Module, pad_id: int, prompts: list[list[int]],
                     max_tokens: int, batch_size: int, eos_id: int | None) -> tuple[int, float]:
    """(generated tokens, seconds) for static, left-padded batches of B prompts in order."""
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm up
    tokens = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
        tokens += sum(_useful_tokens(row, eos_id) for row in out[:, width:].tolist())
    return tokens, time.perf_counter() - start


def _useful_tokens(row: list[int], eos_id: int | None) -> int:
    """Generated tokens up to and including the first EOS (padding after it is not output)."""
    return row.index(eos_id) + 1 if eos_id is not None and eos_id in row else len(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="16,64",
                        help="comma-separated: the engine's max_num_seqs and transformers' "
                             "static batch size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both sides (default: torch's choice)")
    parser.add_argument("--kv-cache-memory", default=None, help="engine KV cache, e.g. 1GiB")
    parser.add_argument("--honour-eos", action="store_true",
                        help="stop each request at EOS on both sides (continuous batching "
                             "refills finished slots; static batches run to their longest "
                             "member); tokens/s counts only tokens up to EOS")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kv_memory = parse_memory_size(args.kv_cache_memory) if args.kv_cache_memory else None

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = tokenize(tokenizer, load_prompts(args.num_prompts))
    lengths = sorted(len(p) for p in prompts)
    print(f"model {args.model}, fp32, cpu, {torch.get_num_threads()} threads; "
          f"{len(prompts)} prompts of {lengths[0]}..{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]}), {args.max_tokens} new tokens, greedy, "
          f"EOS {'honoured' if args.honour_eos else 'ignored'}", flush=True)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    rows = []
    for batch_size in batch_sizes:
        engine_tokens, engine_s = run_engine(model_dir, prompts, args.max_tokens, batch_size,
                                             kv_memory, args.honour_eos)
        print(f"  engine       B={batch_size}: {engine_tokens} tokens in {engine_s:.1f} s",
              flush=True)
        eos_id = tokenizer.eos_token_id if args.honour_eos else None
        hf_tokens, hf_s = run_transformers(hf_model, pad_id, prompts, args.max_tokens,
                                           batch_size, eos_id)
        print(f"  transformers B={batch_size}: {hf_tokens} tokens in {hf_s:.1f} s", flush=True)
        rows.append((batch_size, engine_tokens / engine_s, hf_tokens / hf_s))

    print(f"\n{'batch':>5}  {'engine tok/s':>12}  {'transformers tok/s':>18}  {'ratio':>6}")
    for batch_size, engine_tps, hf_tps in rows:
        ratio = engine_tps / hf_tps
        print(f"{batch_size:>5}  {engine_tps:>12.1f}  {hf_tps:>18.1f}  {ratio:>5.2f}x")


if __name__ == "__main__":
    main()
