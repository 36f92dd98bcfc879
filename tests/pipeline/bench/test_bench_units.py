"""The bench's pure parts: percentiles, output agreement, medians and ratios, options."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
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
from pipeline.bench.bench_file import cpu_description
from pipeline.bench.config import BenchConfig, parse_int_list
from pipeline.bench.metrics import Agreement, RunRecord, bench_row, percentile
from pipeline.bench.report import _best_vs_k0, equality_section, exact_arithmetic, ratio_cell
from pipeline.bench.runner import turns
from pipeline.bench.workload import Workload
from pipeline.config import JobError


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)


def test_agreement_counts_equal_requests_and_the_first_divergence() -> None:
    reference = {"0": (5, 6, 7), "1": (8, 9), "2": (1,)}
    same = Agreement(reference, dict(reference))
    assert (same.equal, same.compared, same.first_divergence) == (3, 3, None)
    other = Agreement(reference, {"0": (5, 6, 4), "1": (8,), "2": (1,)})
    assert (other.equal, other.compared, other.first_divergence) == (1, 3, 1)
    missing = Agreement(reference, {"1": (8, 9), "2": (1,)})
    assert (missing.equal, missing.first_divergence) == (2, 0)


def test_bench_row_from_a_record() -> None:
    record = RunRecord("engine", 2, 4, t0=10.0)
    record.first_token("a", 10.5)
    record.finish("a", (1, 2, 3), 11.0)
    record.finish("b", (4,), 12.0)  # finished in its first step: ttft = latency
    record.spec.drafted, record.spec.accepted, record.spec.draft_steps = 6, 3, 3
    record.spec.add_positions([2, 1])
    record.end = 12.0
    row = bench_row(record, 7, 1, Agreement({"a": (1, 2, 3), "b": (4,)}, record.outputs))
    assert row["output_tokens"] == 4 and row["wall_seconds"] == 2.0
    assert row["output_tokens_per_s"] == 2.0 and row["requests_per_s"] == 1.0
    assert (row["latency_mean_s"], row["latency_p50_s"]) == (1.5, 1.5)
    assert (row["ttft_mean_s"], row["ttft_p50_s"]) == (1.25, 1.25)
    assert row["acceptance_rate"] == 0.5 and row["mean_acceptance_length"] == 2.0
    assert row["per_position_acceptance"] == [2 / 3, 1 / 3]
    assert (row["order"], row["repeat"], row["outputs_equal"]) == (7, 1, 2)


def test_a_paused_run_leaves_the_pause_out_of_its_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    record = RunRecord("engine", 0, 1)  # t0 = 100
    now[0] = 102.0
    record.finish("0", (1, 2), record.clock())
    record.pause()  # another variant runs its part for 30 s
    now[0] = 132.0
    assert record.resume() is record
    now[0] = 133.0
    record.first_token("1", record.clock())
    now[0] = 135.0
    record.finish("1", (3, 4, 5, 6), record.clock())
    record.pause()
    now[0] = 200.0  # paused clocks do not run: the end stays where the last part ended
    row = bench_row(record, 0, 0, Agreement(record.outputs, record.outputs))
    assert record.end == 105.0 and row["wall_seconds"] == 5.0
    assert row["output_tokens_per_s"] == 6 / 5
    assert (row["latency_mean_s"], row["latency_p99_s"]) == (3.5, pytest.approx(4.97))
    assert row["ttft_mean_s"] == 2.5  # request 0 finished in its first step: ttft 2, then 3


def test_turns_go_request_by_request_at_batch_1_only() -> None:
    workload = Workload([(1, 2), (3,), (4, 5, 6)], [8, 7, 6], False, 1)
    parts = turns(workload, 1)
    assert [p.request_ids() for p in parts] == [["0"], ["1"], ["2"]]
    assert [(p.prompts, p.max_tokens) for p in parts] == [([(1, 2)], [8]), ([(3,)], [7]),
                                                          ([(4, 5, 6)], [6])]
    assert [r.request_id for r in parts[2].requests()] == ["2"]
    assert parts[2].requests()[0].params.max_tokens == 6
    assert turns(workload, 3) == [workload] and turns(workload, 64) == [workload]
    assert workload.part(1, 3).part(1, 2).request_ids() == ["2"]


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


def test_options_are_checked() -> None:
    assert parse_int_list("1, 4,16") == (1, 4, 16)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_int_list("1,x")
    # an empty entry is an error, not skipped; values are checked as typed
    for text, minimum, message in (("1,,2", 1, "expected comma-separated integers >= 1, got "
                                                "'1,,2'"),
                                   ("", 0, "expected comma-separated integers >= 0, got ''"),
                                   ("-1", 0, "expected integers >= 0, got '-1'"),
                                   ("0,4", 1, "expected integers >= 1, got '0,4'"),
                                   ("2, 3,2", 0, "repeats 2 in '2, 3,2'")):
        with pytest.raises(ValueError) as raised:
            parse_int_list(text, minimum)
        assert str(raised.value) == message
    with pytest.raises(JobError, match="^--k must be integers >= 0 \\(0 = no drafter\\), "
                                       "got '0,-1'$"):
        BenchConfig("p.parquet", "out", ks=(0, -1))
    with pytest.raises(JobError, match="^--batch-sizes repeats 4 in '1,4,4'$"):
        BenchConfig("p.parquet", "out", batch_sizes=(1, 4, 4))
    with pytest.raises(JobError, match="^--k repeats 0,2 in '0,2,2,0'$"):
        BenchConfig("p.parquet", "out", ks=(0, 2, 2, 0))
    assert BenchConfig("p", "o", model="random:llama-3-8b").random_preset == "llama-3-8b"
    assert BenchConfig("p", "o", ks=(0, 1, 3)).speculative_ks == (1, 3)


def test_cpu_description_names_the_model_and_the_features_that_set_the_speed() -> None:
    cores = f"{platform.machine()}, {os.cpu_count()} cores"
    xeon = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n\n"
            "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert cpu_description(xeon) == (f"cpu: Intel(R) Xeon(R) Platinum 8480+ ({cores}, AVX-512, "
                                     "AVX-512 bfloat16, AMX)")
    epyc = "model name : AMD EPYC\nflags : avx2 fma\n"
    assert cpu_description(epyc) == f"cpu: AMD EPYC ({cores})"
    assert cpu_description("") == f"cpu ({cores})"


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


def test_a_resumed_jobs_shards_plot_in_separate_runs() -> None:
    from pipeline.bench.job_timeline import time_segments, time_unit  # noqa: PLC0415

    spans = [(0.0, 60.0, 10.0), (60.0, 120.0, 11.0), (900.0, 960.0, 12.0),
             (905.0, 970.0, 13.0)]  # two workers after the resume
    assert time_segments(spans, [-5.0, 850.0]) == [[(1.0, 10.0), (2.0, 11.0)],
                                                   [(16.0, 12.0), (970 / 60, 13.0)]]
    # the runs the manifest recorded split the line, not the gaps between shards
    assert time_segments(spans, [-5.0]) == [[(1.0, 10.0), (2.0, 11.0), (16.0, 12.0),
                                             (970 / 60, 13.0)]]
    assert time_segments(spans[:2], [-5.0, 100.0], scale=1.0) == [[(60.0, 10.0)],
                                                                  [(120.0, 11.0)]]
    assert time_unit(100.0) == ("seconds", 1.0) and time_unit(600.0) == ("minutes", 60.0)
    assert time_unit(5 * 3600.0) == ("hours", 3600.0)


def test_busy_seconds_count_overlapping_shards_once() -> None:
    from pipeline.stats import busy_seconds  # noqa: PLC0415

    assert busy_seconds([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0)]) == 17.0
    assert busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == 10.0
    assert busy_seconds([]) == 0.0


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


def test_a_job_of_many_shards_plots_its_tokens_per_s_in_stretches(tmp_path: Path) -> None:
    """1,654 one-row shards drew 1,654 points (those of error rows at 0): a solid block. Above
    200 shards the plot shows the tokens/s of the shards committed in each of 100 stretches."""
    from pipeline.bench.job_timeline import binned_rates, throughput_plot  # noqa: PLC0415
    from pipeline.stats import Counts  # noqa: PLC0415

    assert binned_rates([[(0.0, (10.0, 1.0)), (1.0, (30.0, 1.0)), (4.0, (5.0, 5.0))]], 2) == [
        [(1.0, 20.0), (3.0, 1.0)]]
    assert binned_rates([[(0.0, (0.0, 0.0))], [(8.0, (8.0, 2.0))]], 4) == [
        [(1.0, 0.0)], [(7.0, 4.0)]]  # two runs stay apart; an error-only stretch reads 0
    # 400 shards of 1 s each, one after the other; every other one only error rows (no tokens,
    # no time): each stretch of 2 s holds 2 shards of 10 tokens in 1 s each -> 10 tokens/s
    shards, spans = {}, {}
    for s in range(400):
        errors = s % 2 == 1
        shards[s] = Counts(rows=1, errors=int(errors), completion_tokens=0 if errors else 10,
                           wall_seconds=0.0 if errors else 1.0)
        spans[s] = (float(s // 2), float(s // 2) + (0.0 if errors else 1.0))
    drawn = throughput_plot(shards, spans, [{"started": -1.0}], tmp_path / "t.png")
    points = drawn["output tokens/s"]
    assert len(points) == 100 and {rate for _, rate in points} == {10.0}
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_runs_runner_is_described_with_its_workers() -> None:
    from pipeline.bench.job_report import _run  # noqa: PLC0415

    assert _run({"runner": "local"}) == "start unknown (local)"
    assert _run({"runner": "ray", "workers": 1}) == "start unknown (ray, 1 worker)"
    assert _run({"runner": "ray", "workers": 4}) == "start unknown (ray, 4 workers)"
    assert _run({"runner": "ray", "workers": None}) == (
        "start unknown (ray, workers as the cluster allows (--num-workers not given))")


def test_a_column_of_numbers_side_by_side_is_right_aligned() -> None:
    """The job report's Totals: the per-position acceptance ('74.0% 54.0% 4.0%') left the whole
    value column aligned left (found by QA)."""
    from pipeline.bench.markdown import table  # noqa: PLC0415

    assert table(["total", "value"], [["rows", "282"], ["by position", "74.0% 54.0% 4.0%"]]
                 ).splitlines()[1] == "| --- | ---: |"
    assert table(["a"], [["1.46x (1.31-1.52)"], ["–"], ["shipped"]]).splitlines()[1] == "| --- |"
