"""The header of a bench's report.md: what was measured, on what, and how (the bench's
settings, read from bench.parquet's metadata)."""

from __future__ import annotations

from typing import Any

from pipeline.bench import markdown as md


def header(meta: dict[str, Any], ran: list[int], rounds: dict[int, int] | None = None) -> str:
    """The bench's settings; `ran`: the batch sizes bench.parquet has runs of; `rounds`: how
    many rounds each of them finished."""
    if not meta:
        return ("# eaglebatch bench\n\n> bench.parquet carries no description of its run (the "
                "metadata eaglebatch writes into it is gone: was the file rewritten by another "
                "tool?): model, device, prompts and settings are unknown; the tables come from "
                "its rows alone.")
    config = meta.get("config", {})
    lengths = meta.get("prompt_tokens", {})
    eos = "EOS ignored (every request runs max tokens)" if meta.get("ignore_eos") else \
        "EOS ends a request"
    prompts = meta.get("prompts")
    lines = [
        "# eaglebatch bench",
        "",
        f"- model: `{meta.get('model')}`; drafter: {meta.get('drafter')}",
        f"- device: {meta.get('device')}, {meta.get('dtype')}, "
        f"{_count(meta.get('threads'), 'torch thread')}, torch {meta.get('torch')}; started "
        f"{meta.get('started')}",
        f"- {_count(prompts, 'prompt')} ({lengths.get('min')}..{lengths.get('max')} tokens, "
        f"median {_g(lengths.get('median'))}; {_left_out(meta.get('skipped_prompts', 0))}), at "
        f"most {config.get('max_tokens')} new tokens, greedy, {eos}"
        + _PROMPT_FORMATS.get(meta.get("prompt_format", ""), ""),
        f"- batch sizes {config.get('batch_sizes')}, k {sorted(config.get('ks', []))} (k = 0: "
        f"no drafter), {config.get('repeats')} repeat(s); variants run interleaved in rounds per "
        f"batch size{_turns(meta)}",
        f"- attention backend: {meta.get('attention_backend', 'not recorded')}"
        + (f"; {_confidence(config, meta)}; drafter weights {_drafter_weights(config, meta)}; "
           f"n-gram lookup drafts {_lookups(config)}"
           if any(k > 0 for k in config.get("ks", ())) else ""),
    ]
    missing = [b for b in config.get("batch_sizes", []) if b not in ran]
    repeats = config.get("repeats") or 0
    rounds = rounds or {}
    notices = []  # block quotes, after the list
    if "interrupted" in meta:
        done = "; ".join(f"batch {b}: {rounds[b]} of {repeats}" for b in ran if b in rounds)
        notices += [f"> **Interrupted** (Ctrl-C or SIGTERM) at batch size "
                  f"{meta['interrupted']}: this report holds the rounds that finished before "
                  f"it, batch size(s) {ran}" + (f" (rounds {done})" if done else "")
                  + (f"; {missing} did not run." if missing else ".")]
    else:
        short = [f"batch {b}: {rounds[b]} of {repeats} rounds" for b in ran
                 if rounds.get(b, repeats) < repeats]
        if missing or short:
            notices += ["> **Incomplete.** The bench stopped (it was killed?) before all its "
                      "runs: " + "; ".join(([f"batch size(s) {missing} did not run"]
                                            if missing else []) + short) + "."]
    if isinstance(prompts, int) and (over := [b for b in ran if b > prompts]):
        lines.append(f"- batch size(s) {over} exceed the {prompts} prompts: at most {prompts} "
                     f"requests were in flight there, so those figures are batch {prompts}'s")
    if not on_cuda(meta) and "huge_pages" in meta:
        lines.append("- the engines' packed weights in transparent huge pages" if meta["huge_pages"]
                     else "- the engines' packed weights in ordinary 4 KiB pages (no transparent "
                     "huge pages here, or EAGLEBATCH_HUGE_PAGES=0)")
    if meta.get("clamped"):
        lines.append(f"- {_count(meta['clamped'], 'request')} "
                     f"{'gets' if meta['clamped'] == 1 else 'get'} fewer than "
                     f"{config.get('max_tokens')} new tokens: the prompt leaves less room in the "
                     f"model's context of {meta.get('max_model_len')} tokens")
    if config.get("baseline") == "none":
        lines.append("- no transformers baseline (`--baseline none`): engine variants only")
    speculative = any(k > 0 for k in config.get("ks", ()))
    if config.get("draft_max_batch"):
        lines.append(f"- greedy requests draft only in steps of at most "
                     f"{config['draft_max_batch']} requests (`--draft-max-batch`, as `generate` "
                     f"does): larger steps of the k > 0 variants run without drafts")
    elif speculative:
        lines.append("- the k > 0 variants may draft at every batch size (`--draft-max-batch 0`, "
                     "bench's default); `generate` drafts only in steps of at most 4 requests "
                     "by default")
    if config.get("kv_cache_memory"):
        lines.append(f"- KV cache: {md.size(config['kv_cache_memory'])} per engine "
                     "(`--kv-cache-memory`)"
                     + ("; the drafter's layers take their share of it, so the k > 0 variants "
                        "hold fewer of the target's blocks" if speculative else ""))
    else:
        lines.append("- KV cache: sized for each engine's whole batch")
    lines.append(_prefix_line(config, meta))
    if config.get("q4_panels"):
        lines.append(_q4_line(meta.get("q4_weights")))
    if config.get("cuda_graphs"):
        lines.append("- CUDA graphs (`--cuda-graphs`): the engines replay decode steps from "
                     "graphs")
    if config.get("ceiling"):
        lines.append("- perfect drafts (`--ceiling`): every k > 0 also ran with the k = 0 run's "
                     "own next tokens as its drafts (always k, no confidence cut); the drafter "
                     "still runs, so each step costs what drafting costs")
    for notice in notices:
        lines += ["", notice]
    if meta.get("random_weights"):
        lines += ["", "> **Random weights.** The model (and any drafter) has random weights in "
                  "the shape of the real architecture: throughput is the architecture's, but "
                  "outputs are noise and the acceptance figures are meaningless. Prompts are "
                  "tokenized byte by byte (one token per UTF-8 byte: longer prompts than the "
                  "real tokenizer gives, as the prompt lengths above show)"
                  + (" (n-gram lookup drafts were on: a random model's output often repeats, "
                     "and accepted lookups make drafting look cheaper than it is)."
                     if config.get("draft_ngram") else ".")]
    elif meta.get("random_drafter"):
        lines += ["", "> **Random drafter** (`--drafter random`): the drafter has random "
                  "weights, so its drafts are accepted only by chance and the acceptance figures "
                  "say nothing about a trained one; the k > 0 runs measure what drafting costs"
                  + (" (n-gram lookup drafts were on: where the generated text repeats, their "
                     "accepted lookups gain as well)." if config.get("draft_ngram") else ".")]
    return "\n".join(lines)


# bench.parquet's prompt_format -> how the header says prompts were tokenized
_PROMPT_FORMATS = {
    "chat": "; prompts as the user message of the model's chat template",
    "messages": "; messages rendered with the model's chat template",
    "raw": "; prompts tokenized as raw text (`--no-chat-template`)",
    "raw: no template": "; prompts tokenized as raw text: the model's tokenizer has no chat "
                        "template",
}


def _count(value: Any, noun: str) -> str:
    return md.plural(value, noun) if isinstance(value, int) else f"{value} {noun}s"


def _g(value: Any) -> str:
    """A median of token counts: '48' or '47.5'."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _left_out(skipped: int) -> str:
    if not skipped:
        return "none left out"
    return (f"{skipped} left out: null, empty, malformed messages, or too long for the model's "
            "context")


def _confidence(config: dict[str, Any], meta: dict[str, Any]) -> str:
    cut = config.get("draft_confidence", 0.0)
    every = "" if config.get("draft_ngram") else ": k drafts every step"  # lookups vary it
    if meta.get("random_drafter"):
        return ("drafts never cut by the drafter's confidence (a random drafter's confidence "
                f"means nothing{every})")
    if not cut:
        return f"drafts never cut by the drafter's confidence{f' ({every[2:]})' if every else ''}"
    return f"drafts cut below drafter confidence {cut}"


def acceptance_meaningless(meta: dict[str, Any]) -> str:
    if meta.get("random_weights"):
        return "random weights: meaningless"
    if meta.get("random_drafter"):
        return "random drafter: meaningless"
    return ""


def _q4_line(counts: list[int] | None) -> str:
    """What --q4-panels did: counts = [weight matrices with 4-bit panels, on panels]."""
    if counts is None:
        return ("- 4-bit panels (`--q4-panels`): products of up to 12 rows read 4-bit copies of "
                "the weights that are exactly GGUF Q4_1 values (how many are was not recorded)")
    with_q4, total = counts
    if with_q4 == 0:
        return (f"- 4-bit panels (`--q4-panels`) asked for, but none of the model's {total} "
                f"weight matrices are exactly GGUF Q4_1 values: every product read its usual "
                f"panels")
    return (f"- 4-bit panels (`--q4-panels`): products of up to 12 rows read 4-bit copies of "
            f"the {with_q4} of {total} weight matrices that are exactly GGUF Q4_1 values (the "
            f"same bits)")


def _prefix_line(config: dict[str, Any], meta: dict[str, Any]) -> str:
    """Whether the engines cached prompt prefixes, and what that served (benches written before
    the option ran without)."""
    if not config.get("prefix_caching"):
        flag = " (`--no-prefix-caching`)" if "prefix_caching" in config else ""
        return f"- prefix caching off{flag}: every request computed its whole prompt"
    hits = meta.get("prefix_cache_hits") or {}
    served = "; ".join(f"batch {b}: {md.plural(h, 'prompt token')} of {q:,} ({h / q:.0%})"
                       for b, (h, q) in sorted(hits.items(), key=lambda kv: int(kv[0])) if q)
    return ("- prefix caching on, as in `generate`, emptied before each run (a run reuses only "
            "the blocks its own requests share, such as a chat template's system prompt, never "
            "an earlier run's prompts)" + (f"; served from the cache in the first k = 0 run: "
                                           f"{served}" if served else ""))


def _turns(meta: dict[str, Any]) -> str:
    if meta.get("batch1_turns") == "request" and 1 in meta.get("config", {}).get("batch_sizes",
                                                                                 [1]):
        return (" (at batch size 1 request by request, each run's clock stopped while the others"
                " run)")
    return ""


def _drafter_weights(config: dict[str, Any], meta: dict[str, Any]) -> str:
    if not config.get("draft_int8"):
        return "as stored"
    if on_cuda(meta):
        return "in the model's dtype (int8 copies are a CPU feature)"
    return "int8 copies"


def on_cuda(meta: dict[str, Any]) -> bool:
    return meta.get("copy_bandwidth_bytes_per_s") is not None  # measured on CUDA only


def _lookups(config: dict[str, Any]) -> str:
    if not config.get("draft_ngram"):
        return "off"
    longest = config.get("draft_ngram_tokens") or 0
    return (f"on (up to {longest} drafts for a greedy request alone in its step)" if longest
            else "on")
