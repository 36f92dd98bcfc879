"""The bench's measurements and options: percentiles, output agreement, a run's row (its clock
paused while other variants run), turns at batch 1, the options' checks, the CPU's
description."""

from __future__ import annotations

import os
import platform
import time

import pytest

from pipeline.bench.bench_file import cpu_description
from pipeline.bench.config import BenchConfig, parse_int_list
from pipeline.bench.metrics import Agreement, RunRecord, bench_row, percentile
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
