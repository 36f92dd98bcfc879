"""`eaglebatch generate`'s options as a JobConfig (with its EngineConfig and RayConfig)."""

from __future__ import annotations

from typing import Any

import click

from pipeline.config import JobConfig, JobError, RayConfig
from runtime.config import CLI_DRAFT_MAX_BATCH, DEFAULT_MODEL, EngineConfig
from runtime.loader import default_drafter


def drafter_path(model: str, option: str) -> str | None:
    """'none' -> None; 'auto' -> the drafter shipped for the model, if any; else a path."""
    if option == "none":
        return None
    if option == "auto":
        shipped = default_drafter(model)
        if shipped is None and model == DEFAULT_MODEL:  # drafters/ is not in a built wheel
            click.echo(f"note: the drafter shipped for {model} is not installed (it is read "
                       "from the source tree: install with pip install -e .); decoding "
                       "without one", err=True)
        return None if shipped is None else str(shipped)
    return option


def draft_max_batch(o: dict[str, Any]) -> int | None:
    """--draft-max-batch: given (0: None, any batch), else 4, or 1 with --q4-panels (its
    4-bit products make the plain steps of small batches so cheap that drafting loses from
    batch 4: 0.89x)."""
    given = o["draft_max_batch"]
    if given is None:
        return 1 if o["q4_panels"] else CLI_DRAFT_MAX_BATCH
    return given or None


def job_config(o: dict[str, Any]) -> JobConfig:
    ray_options = {"--num-workers": o["num_workers"], "--ray-address": o["ray_address"],
                   "--gpus-per-worker": o["gpus_per_worker"]}
    given = [name for name, value in ray_options.items() if value is not None]
    if o["runner"] == "local" and given:
        raise JobError(f"{given[0]} is an option of --runner ray")
    ray = None if o["runner"] == "local" else RayConfig(
        o["ray_address"], o["num_workers"], o["gpus_per_worker"])
    engine = EngineConfig(
        model=o["model"], drafter=drafter_path(o["model"], o["drafter"]),
        num_speculative_tokens=o["num_speculative_tokens"],
        draft_confidence=o["draft_confidence"], draft_max_batch=draft_max_batch(o),
        draft_int8=o["draft_int8"], q4_panels=o["q4_panels"], draft_ngram=o["draft_ngram"],
        draft_ngram_tokens=o["draft_ngram_tokens"],
        attention_backend=o["attention_backend"], cuda_graphs=o["cuda_graphs"],
        dtype=o["dtype"], device=o["device"], kv_cache_memory=o["kv_cache_memory"],
        max_num_batched_tokens=o["max_num_batched_tokens"], max_model_len=o["max_model_len"],
        max_num_seqs=o["max_num_seqs"], block_size=o["block_size"], num_threads=o["threads"])
    return JobConfig(
        input=o["input"], output_dir=o["output_dir"], prompt_column=o["prompt_column"],
        id_column=o["id_column"], messages_column=o["messages_column"],
        output_prefix=o["output_prefix"],
        chat_template=not o["no_chat_template"], shard_rows=o["shard_rows"], n=o["n"],
        overwrite=o["overwrite"], max_tokens=o["max_tokens"], min_tokens=o["min_tokens"],
        temperature=o["temperature"],
        top_p=o["top_p"], top_k=o["top_k"], min_p=o["min_p"], seed=o["seed"],
        stop=tuple(o["stop"]), stop_token_ids=o["stop_token_ids"], ignore_eos=o["ignore_eos"],
        include_stop_str_in_output=o["include_stop_str_in_output"],
        repetition_penalty=o["repetition_penalty"], frequency_penalty=o["frequency_penalty"],
        presence_penalty=o["presence_penalty"], allowed_token_ids=o["allowed_token_ids"],
        logit_bias=o["logit_bias"], guided_choice=tuple(sorted(set(o["guided_choice"]))),
        guided_regex=o["guided_regex"], guided_json=o["guided_json"], logprobs=o["logprobs"],
        top_logprobs=o["top_logprobs"], prompt_logprobs=o["prompt_logprobs"], engine=engine,
        ray=ray)
