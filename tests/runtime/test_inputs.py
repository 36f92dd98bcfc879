"""prepare_inputs on the worked example of runtime/inputs.py's docstring, with exact values."""

from __future__ import annotations

import torch

from runtime.config import SamplingParams
from runtime.inputs import SampleRow, prepare_inputs
from runtime.scheduler import ScheduledSeq, SchedulerOutput
from runtime.sequence import Sequence

BLOCK_SIZE = 4
CPU = torch.device("cpu")
A_TOKENS = [10, 11, 12, 13, 14, 15]  # a0..a5
A_DRAFTS = [20, 21]  # d0, d1
B_TOKENS = [30, 31, 32]  # b0..b2


def _seq(request_id: str, tokens: list[int], num_computed: int, drafts: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens, SamplingParams(), arrival=0, num_speculative_tokens=2)
    seq.num_computed_tokens = num_computed
    seq.draft_token_ids = list(drafts)
    return seq


def _output(*scheduled: ScheduledSeq) -> SchedulerOutput:
    return SchedulerOutput(tuple(scheduled), sum(s.num_new_tokens for s in scheduled), ())


def test_docstring_worked_example() -> None:
    # A: 6 tokens, 5 computed, 2 drafts -> feeds [a5, d0, d1] at positions 5..7.
    # B: fresh 3-token prompt cut by the budget to 2 tokens -> feeds [b0, b1], does not sample.
    a = _seq("A", A_TOKENS, 5, A_DRAFTS)
    b = _seq("B", B_TOKENS, 0, [])
    out = _output(ScheduledSeq(a, 5, 3), ScheduledSeq(b, 0, 2))
    step = prepare_inputs(out, [[7, 9], [3]], BLOCK_SIZE, CPU)

    assert step.input_ids.tolist() == [15, 20, 21, 30, 31]
    assert step.input_ids.dtype == torch.int64
    assert step.positions.tolist() == [5, 6, 7, 0, 1]
    md = step.metadata
    # slot = block * 4 + offset: A pos 5..7 -> block 9, B pos 0..1 -> block 3
    assert md.slot_mapping.tolist() == [37, 38, 39, 12, 13]
    assert md.query_lens == [3, 2]
    assert md.seq_lens_host == [8, 2]
    assert md.seq_lens.tolist() == [8, 2]
    assert md.query_start_loc.tolist() == [0, 3, 5]
    assert md.block_table.tolist() == [[7, 9], [3, 0]]  # 0-padded with the null block
    assert (md.max_query_len, md.max_seq_len) == (3, 8)
    # a5 predicts the token after it (verifies d0), d0 verifies d1, d1 gives the bonus token
    assert step.sample_rows == [SampleRow(0, [0, 1, 2], [20, 21])]
    assert step.block_tables == [[7, 9], [3]]


def test_prefill_chunk_reaching_the_prompt_end_samples_its_last_row() -> None:
    # B's second chunk (b2) finishes its prompt; A decodes without drafts.
    a = _seq("A", A_TOKENS, 5, [])
    b = _seq("B", B_TOKENS, 2, [])
    step = prepare_inputs(_output(ScheduledSeq(b, 2, 1), ScheduledSeq(a, 5, 1)),
                          [[3], [7, 9]], BLOCK_SIZE, CPU)

    assert step.input_ids.tolist() == [32, 15]
    assert step.positions.tolist() == [2, 5]
    assert step.metadata.slot_mapping.tolist() == [14, 37]
    assert step.metadata.query_lens == [1, 1]
    assert step.metadata.seq_lens_host == [3, 6]
    assert step.sample_rows == [SampleRow(0, [0], []), SampleRow(1, [1], [])]


def test_partial_draft_feed_verifies_only_the_drafts_fed() -> None:
    # The budget cut A to [a5, d0]: it samples from both rows and verifies only d0.
    a = _seq("A", A_TOKENS, 5, A_DRAFTS)
    step = prepare_inputs(_output(ScheduledSeq(a, 5, 2)), [[7, 9]], BLOCK_SIZE, CPU)

    assert step.input_ids.tolist() == [15, 20]
    assert step.metadata.slot_mapping.tolist() == [37, 38]
    assert step.sample_rows == [SampleRow(0, [0, 1], [20])]
