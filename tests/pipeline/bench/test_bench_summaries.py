"""The bench report's figures and text from its rows: medians, ratios and the best k, acceptance,
the throughput table, the header, the equality section, markdown tables."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.bench import markdown as md
from pipeline.bench.aggregate import (
    acceptance_by_k,
    best_k,
    ratio,
    round_ratios,
    speedup_vs_k0,
    summarize,
)
from pipeline.bench.report import _best_vs_k0, equality_section, exact_arithmetic, ratio_cell


def _row(batch: int, variant: str, k: int, tps: float, **extra: Any) -> dict[str, Any]:
    return {"batch_size": batch, "variant": variant, "k": k, "output_tokens_per_s": tps,
            "drafted": 0, "accepted": 0, "draft_steps": 0, "accepted_per_position": [], **extra}


def test_medians_ratios_and_best_k() -> None:
    rows = [_row(1, "engine", 0, 10.0), _row(1, "engine", 0, 14.0), _row(1, "engine", 0, 12.0),
            _row(1, "engine", 3, 18.0), _row(1, "transformers", 0, 6.0),
            _row(8, "engine", 0, 40.0), _row(8, "engine", 3, 30.0)]
    summaries = summarize(rows)
    assert list(summaries) == [(1, "transformers", 0), (1, "engine", 0), (1, "engine", 3),
                               (8, "engine", 0), (8, "engine", 3)]
    k0 = summaries[(1, "engine", 0)]
    assert k0.tokens_per_s == 12.0 and k0.spread == pytest.approx(4 / 12)
    assert summaries[(1, "engine", 3)].spread is None
    assert ratio(summaries, (1, "engine", 0), (1, "transformers", 0)) == 2.0
    assert ratio(summaries, (8, "engine", 0), (8, "transformers", 0)) is None
    assert speedup_vs_k0(summaries, 1, 3) == 1.5 and speedup_vs_k0(summaries, 8, 3) == 0.75
    assert best_k(summaries, 1).k == 3 and best_k(summaries, 8).k == 0  # type: ignore[union-attr]


def test_variants_that_drafted_nothing_are_named_under_the_ratios() -> None:
    """Found by a reviewer: with every draft cut below the confidence at batch 8, the ratios
    read as the drafter's without a word."""
    from pipeline.bench.report import _ratios  # noqa: PLC0415

    rows = [_row(1, "engine", 0, 10.0, repeat=0), _row(1, "engine", 2, 15.0, repeat=0, drafted=8),
            _row(1, "engine", 1, 12.0, repeat=0, drafted=3), _row(8, "engine", 0, 40.0, repeat=0),
            _row(8, "engine", 2, 30.0, repeat=0), _row(8, "engine", 1, 35.0, repeat=0)]
    text = " ".join(_ratios(summarize(rows)).split())
    assert ("Nothing was drafted at batch 8 k=1, batch 8 k=2 (drafts cut below the confidence, "
            "steps larger than `--draft-max-batch`, or no token left to draft): those ratios "
            "measure keeping the drafter, not drafting.") in text
    assert "Nothing was drafted" not in _ratios(summarize(rows[:3]))


def test_round_ratios_pair_runs_of_the_same_round() -> None:
    rows = [_row(1, "engine", 0, 10.0, repeat=0), _row(1, "engine", 3, 18.0, repeat=0),
            _row(1, "engine", 0, 14.0, repeat=1), _row(1, "engine", 3, 14.0, repeat=1),
            _row(1, "engine", 0, 12.0, repeat=2), _row(1, "engine", 3, 24.0, repeat=2)]
    summaries = summarize(rows)
    assert round_ratios(summaries, (1, "engine", 3), (1, "engine", 0)) == [1.0, 1.8, 2.0]
    assert speedup_vs_k0(summaries, 1, 3) == 1.5  # 18 / 12: medians, not paired
    assert round_ratios(summaries, (1, "engine", 3), (1, "transformers", 0)) == []
    assert ratio_cell(summaries, (1, "engine", 3), (1, "engine", 0)) == \
        "1.50x (1.00-2.00, rounds' median 1.80x)"
    two_rounds = summarize(rows[:4])
    assert ratio_cell(two_rounds, (1, "engine", 3), (1, "engine", 0)) == "1.33x (1.00-1.80)"
    one_round = summarize(rows[:2])
    assert ratio_cell(one_round, (1, "engine", 3), (1, "engine", 0)) == "1.80x"
    # the best k over k = 0: marked where its rounds fall on both sides of 1.0x
    assert _best_vs_k0(summaries, 1, 3) == "1.50x (not above the noise: rounds 1.00-2.00)"
    clear = summarize(rows[:2] + rows[4:])  # rounds 1.80x and 2.00x
    assert _best_vs_k0(clear, 1, 3) == "1.91x"
    assert _best_vs_k0(one_round, 1, 3) == "1.80x"  # one round: nothing to tell noise by


def test_acceptance_sums_counts_over_batch_sizes() -> None:
    rows = [_row(1, "engine", 2, 1.0, drafted=10, accepted=6, draft_steps=5,
                 accepted_per_position=[4, 2]),
            _row(4, "engine", 2, 1.0, drafted=10, accepted=2, draft_steps=5,
                 accepted_per_position=[2, 0]),
            _row(4, "engine", 0, 1.0)]
    by_k = acceptance_by_k(rows)
    assert list(by_k) == [2]
    derived = by_k[2].derived()
    assert derived["acceptance_rate"] == 0.4 and derived["mean_acceptance_length"] == 1.8
    assert derived["per_position_acceptance"] == [0.6, 0.2]


def test_markdown_table_aligns_numbers_right() -> None:
    assert md.table(["b", "variant", "tokens/s"], [["1", "engine k=0", "1,234.5"]]) == (
        "| b | variant | tokens/s |\n| ---: | --- | ---: |\n| 1 | engine k=0 | 1,234.5 |")
    assert md.table(["b", "k=2"], [["1", "1.31x (1.25-1.47)"]]).splitlines()[1] == \
        "| ---: | ---: |"
    assert (md.ratio(1.234), md.pct(0.5), md.ms(0.0123), md.num(None)) == (
        "1.23x", "50.0%", "12", "–")
    # a short row's blank cells keep its column right-aligned
    assert md.table(["k", "pos 3"], [["2", ""], ["3", "15.7%"]]).splitlines()[1] == \
        "| ---: | ---: |"
    assert (md.plural(1, "prompt"), md.plural(1600, "prompt")) == ("1 prompt", "1,600 prompts")


def test_an_equality_failure_is_called_a_bug_only_where_outputs_must_be_bit_equal() -> None:
    rows = [{"variant": "engine", "k": k, "batch_size": 16, "repeat": 0, "outputs_compared": 32,
             "outputs_equal": equal, "first_divergence": first}
            for k, equal, first in ((0, 32, None), (2, 14, 11))]
    cpu32 = {"dtype": "float32", "attention_backend": "cpu", "copy_bandwidth_bytes_per_s": None}
    gpu16 = {"dtype": "bfloat16", "attention_backend": "torch",
             "copy_bandwidth_bytes_per_s": 4.2e12}
    assert exact_arithmetic(cpu32) and not exact_arithmetic(gpu16)
    assert not exact_arithmetic(cpu32 | {"attention_backend": "torch"})
    assert not exact_arithmetic(cpu32 | {"dtype": "bfloat16"})
    on_cpu = equality_section(rows, cpu32)
    assert "**FAIL**: 1 of 2 engine runs differ" in on_cpu and "| 16 | engine k=2 | 0 | 14/32 |" \
        in on_cpu
    assert "This is a bug" in on_cpu and "Expected" not in on_cpu
    on_gpu = equality_section(rows, gpu16)
    assert "Expected with bfloat16 and the torch attention backend on CUDA" in on_gpu
    assert "bug" not in on_gpu
    rows[1] |= {"outputs_equal": 32, "first_divergence": None}
    passed = equality_section(rows, gpu16)
    assert "**PASS**" in passed and "Expected" not in passed
    alone = equality_section(rows[:1], cpu32)  # one run: compared with itself, not checked
    assert "**Not checked**: there was one engine run, with nothing to compare it to" in alone
    assert "PASS" not in alone


def test_a_random_drafter_is_named_and_its_acceptance_called_meaningless() -> None:
    from pipeline.bench.report import _acceptance  # noqa: PLC0415
    from pipeline.bench.report_header import header as bench_header  # noqa: PLC0415

    meta = {"prompts": 1, "threads": 1, "prompt_tokens": {"min": 5, "median": 5.0, "max": 5},
            "skipped_prompts": 2, "random_drafter": True,
            "config": {"batch_sizes": [1], "ks": [0, 2], "repeats": 1,
                       "draft_confidence": 0.0}}
    header = bench_header(meta, [1])
    assert "- 1 prompt (5..5 tokens, median 5; 2 left out: null, empty, malformed messages, or " \
           "too long for the model's context)" in header
    assert "1 torch thread," in header
    assert ("drafts never cut by the drafter's confidence (a random drafter's confidence means "
            "nothing: k drafts every step)") in header
    assert "> **Random drafter** (`--drafter random`)" in header
    rows = [_row(0, "engine", 2, 1.0)]
    assert "## Acceptance (all batch sizes and repeats) (random drafter: meaningless)" in \
        _acceptance(rows, meta)
    trained = {**meta, "random_drafter": False, "config": {**meta["config"],
                                                           "draft_confidence": 0.15}}
    assert "drafts cut below drafter confidence 0.15" in bench_header(trained, [1])
    assert "Random drafter" not in bench_header(trained, [1])
    assert "meaningless" not in _acceptance(rows, trained)
    # with lookups on, a step's drafts vary (lookups replace the drafter's where text repeats)
    lookups = {**meta, "config": {**meta["config"], "draft_ngram": True}}
    header = bench_header(lookups, [1])
    assert ("drafts never cut by the drafter's confidence (a random drafter's confidence means "
            "nothing); drafter weights") in header
    assert "every step" not in header
    assert ("the k > 0 runs measure what drafting costs (n-gram lookup drafts were on: where the "
            "generated text repeats, their accepted lookups gain as well).") in header
    untrained = {**meta, "random_drafter": False}
    assert "drafts never cut by the drafter's confidence (k drafts every step)" in \
        bench_header(untrained, [1])
    assert "drafts never cut by the drafter's confidence;" in bench_header(
        {**untrained, "config": lookups["config"]}, [1])


def test_the_header_says_what_did_not_run_and_what_ran_as_a_smaller_batch() -> None:
    from pipeline.bench.report_header import header as bench_header  # noqa: PLC0415

    meta = {"prompts": 3, "config": {"batch_sizes": [1, 4, 64], "ks": [0], "repeats": 3}}
    header = bench_header(meta, [1, 4], {1: 3, 4: 1})
    # a bench killed in batch 4's second round (bench.parquet is written after every round)
    assert ("> **Incomplete.** The bench stopped (it was killed?) before all its runs: batch "
            "size(s) [64] did not run; batch 4: 1 of 3 rounds.") in header
    # after the settings' list, not splitting it in two
    assert header.endswith("\n- KV cache: sized for each engine's whole batch\n"
                           "- prefix caching off: every request computed its whole prompt\n\n"
                           "> **Incomplete.** The bench stopped (it was killed?) before all its "
                           "runs: batch size(s) [64] did not run; batch 4: 1 of 3 rounds.")
    assert ("- batch size(s) [4] exceed the 3 prompts: at most 3 requests were in flight "
            "there, so those figures are batch 3's") in header
    assert "Incomplete" not in bench_header({**meta, "config": {"batch_sizes": [1], "repeats": 3}},
                                       [1], {1: 3})
    assert "no description of its run" in bench_header({}, [1])


def test_the_q4_line_says_how_many_weights_got_4_bit_panels() -> None:
    from pipeline.bench.report_header import _q4_line  # noqa: PLC0415

    assert "asked for, but none of the model's 14 weight matrices" in _q4_line([0, 14])
    assert "the 210 of 210 weight matrices that are exactly GGUF Q4_1" in _q4_line([210, 210])


def test_latencies_read_in_ms_when_every_one_is_under_a_second() -> None:
    from pipeline.bench.report import _throughput  # noqa: PLC0415

    times = {"latency_mean_s": 0.0432, "latency_p50_s": 0.04, "latency_p99_s": 0.0871,
             "ttft_p50_s": 0.0123, "ttft_p99_s": 0.02, "requests_per_s": 23.1,
             "peak_rss_bytes": 300 << 20, "peak_gpu_bytes": None}
    fast = _throughput(summarize([_row(1, "engine", 0, 500.0, **times)]))
    assert "| latency mean ms | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms |" in fast
    assert "| 23.10 | 43.2 | 40.0 | 87.1 | 12.3 | 20.0 |" in fast
    slow = _throughput(summarize([_row(1, "engine", 0, 50.0, **times),
                                  _row(4, "engine", 0, 90.0, **{**times, "latency_p99_s": 1.5})]))
    assert "| latency mean s | p50 s |" in slow and "| 0.04 | 0.04 | 0.09 | 0.01 |" in slow


def test_the_header_states_the_settings_that_change_the_figures() -> None:
    from pipeline.bench.report import _throughput  # noqa: PLC0415
    from pipeline.bench.report_header import header as bench_header  # noqa: PLC0415

    meta = {"prompts": 2, "threads": 1, "prompt_tokens": {"min": 5, "median": 5.0, "max": 5},
            "clamped": 1, "max_model_len": 2048,
            "config": {"batch_sizes": [1], "ks": [0, 2], "repeats": 1, "max_tokens": 3000,
                       "baseline": "none", "kv_cache_memory": 3 << 20, "draft_max_batch": None}}
    header = bench_header(meta, [1])
    assert ("- 1 request gets fewer than 3000 new tokens: the prompt leaves less room in the "
            "model's context of 2048 tokens") in header
    assert "- no transformers baseline (`--baseline none`): engine variants only" in header
    assert ("- the k > 0 variants may draft at every batch size (`--draft-max-batch 0`, bench's "
            "default)") in header
    assert ("- KV cache: 3 MiB per engine (`--kv-cache-memory`); the drafter's layers take their "
            "share of it, so the k > 0 variants hold fewer of the target's blocks") in header
    small = {**meta, "config": {**meta["config"], "kv_cache_memory": 200 << 10}}
    assert "- KV cache: 200 KiB per engine (`--kv-cache-memory`)" in bench_header(  # not 0
        small, [1])
    # prefix caching: off in benches written before the option; on, with no run recorded yet
    assert header.endswith("- prefix caching off: every request computed its whole prompt")
    cached = bench_header({**meta, "config": {**meta["config"], "prefix_caching": True}}, [1])
    assert ("- prefix caching on, as in `generate`, emptied before each run (a run reuses only "
            "the blocks its own requests share, such as a chat template's system prompt, never "
            "an earlier run's prompts)") in cached
    plain = {**meta, "clamped": 0, "config": {**meta["config"], "ks": [0], "baseline":
                                              "transformers", "kv_cache_memory": None}}
    header = bench_header(plain, [1])
    assert "- KV cache: sized for each engine's whole batch" in header
    for absent in ("fewer than", "baseline", "draft at every batch size"):
        assert absent not in header
    # a TTFT of a few ms beside latencies of seconds is not shown as 0.00
    row = {**_row(0, "engine", 0, 50.0), "latency_mean_s": 2.0, "latency_p50_s": 2.0,
           "latency_p99_s": 2.5, "ttft_p50_s": 0.0031, "ttft_p99_s": 0.0049,
           "requests_per_s": 1.0, "peak_rss_bytes": 1 << 30, "peak_gpu_bytes": None}
    table = _throughput(summarize([row]))
    assert "| 2.00 | 2.00 | 2.50 | 0.0031 | 0.0049 |" in table


def test_a_column_of_numbers_side_by_side_is_right_aligned() -> None:
    """The job report's Totals: the per-position acceptance ('74.0% 54.0% 4.0%') left the whole
    value column aligned left (found by QA)."""
    from pipeline.bench.markdown import table  # noqa: PLC0415

    assert table(["total", "value"], [["rows", "282"], ["by position", "74.0% 54.0% 4.0%"]]
                 ).splitlines()[1] == "| --- | ---: |"
    assert table(["a"], [["1.46x (1.31-1.52)"], ["–"], ["shipped"]]).splitlines()[1] == "| --- |"
