"""Turns a SchedulerOutput into the flat tensors of one forward pass.

Built as Python lists and copied to the device once per field. Worked example (block_size 4,
k = 2): seq A has token_ids [a0..a5] (6 tokens, 5 computed) and drafts [d0, d1]; seq B is a fresh
prompt [b0, b1, b2] cut by the budget to 2 tokens.

    A: start 5, num_new 3 -> input_ids [a5, d0, d1], positions [5, 6, 7], samples: yes,
       drafts fed 2, logits rows [0, 1, 2] (a5 predicts the token after it, d0 the next, ...)
    B: start 0, num_new 2 -> input_ids [b0, b1], positions [0, 1], samples: no (b2 not fed yet)
    flat input_ids [a5, d0, d1, b0, b1]; query_lens [3, 2]; seq_lens [8, 2]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.attention import AttentionMetadata, build_attention_metadata
from runtime.kv.cache import compute_slot_mapping
from runtime.scheduler import SchedulerOutput


class SampleRow(NamedTuple):
    """One request that samples this step."""

    seq_index: int  # position in SchedulerOutput.scheduled
    logits_rows: list[int]  # flat token indices whose logits verify drafts + give the next token
    draft_token_ids: list[int]  # drafts fed this step (len(logits_rows) - 1)


class PromptRows(NamedTuple):
    """A prompt chunk's rows whose log-probabilities its request asks for
    (SamplingParams.prompt_logprobs): each row's logits give the next prompt token's."""

    seq_index: int  # position in SchedulerOutput.scheduled
    rows: list[int]  # flat token indices
    next_tokens: list[int]  # the prompt token after each


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: list[SampleRow]
    block_tables: list[list[int]]  # per scheduled seq, host copy
    prompt_rows: list[PromptRows] = []


def prepare_inputs(out: SchedulerOutput, block_tables: list[list[int]], block_size: int,
                   device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_rows: list[SampleRow] = []
    prompt_rows: list[PromptRows] = []
    for i, (sched, table) in enumerate(zip(out.scheduled, block_tables, strict=True)):
        seq, start, n = sched
        offset = len(input_ids)
        tokens = seq.token_ids + seq.draft_token_ids
        input_ids += tokens[start:start + n]
        pos = list(range(start, start + n))
        positions += pos
        slots += compute_slot_mapping(table, pos, block_size)
        query_lens.append(n)
        seq_lens.append(start + n)
        end = start + n
        if end >= len(seq.token_ids):  # the last verified token is fed: this request samples
            first = len(seq.token_ids) - 1 - start
            rows = list(range(offset + first, offset + n))
            drafts = seq.draft_token_ids[:end - len(seq.token_ids)]
            sample_rows.append(SampleRow(i, rows, drafts))
        if seq.needs_prompt_logprobs:
            # position p gives prompt token p + 1's; those before len(prompt_logprobs) are known
            # (a recompute after preemption), and the last prompt position samples instead.
            # Example: a 6-token prompt fed as [0, 4) then [4, 6): rows at positions 0-3 give
            # tokens 1-4, then position 4 gives token 5 and position 5 samples the first output
            assert start <= len(seq.prompt_logprobs), "no prefix hits before they are known"
            first = max(start, len(seq.prompt_logprobs))
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                prompt_rows.append(PromptRows(i, list(range(offset + first - start,
                                                            offset + last - start)),
                                              seq.token_ids[first + 1:last + 1]))
    md = build_attention_metadata(query_lens, seq_lens, block_tables, slots, device)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=md,
        sample_rows=sample_rows,
        block_tables=block_tables,
        prompt_rows=prompt_rows,
    )
