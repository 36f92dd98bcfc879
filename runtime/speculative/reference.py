"""Drafts taken from known outputs: the ceiling of speculative decoding at a batch size.

ReferenceDrafts wraps the engine's proposer. The proposer runs as usual, so every step still pays
for drafting, and then each request's drafts are replaced by the next k tokens of that request's
reference output (its greedy output from an engine without drafter, say). Under greedy decoding
every such draft is accepted, so a run with it measures the most that any drafter costing as much
as this one could gain. Verification is unchanged: the outputs are still the target's own.
Requests without a reference keep the proposer's drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.inputs import StepInputs
    from runtime.model_runner import Proposer
    from runtime.scheduler import SchedulerOutput


class ReferenceDrafts:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int,
                 reference: Mapping[str, Sequence[int]]) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.reference = reference  # request id -> its output tokens
        self.aux_layer_ids = proposer.aux_layer_ids

    def propose(self, step: StepInputs, out: SchedulerOutput, features: torch.Tensor,
                emitted: list[list[int] | None], verified: list[int]) -> list[list[int]]:
        drafts = self.proposer.propose(step, out, features, emitted, verified)
        for i, (seq, _, _) in enumerate(out.scheduled):
            known = self.reference.get(seq.request_id)
            tokens = emitted[i]
            if known is None or tokens is None:
                continue
            generated = seq.num_output_tokens + len(tokens)
            drafts[i] = list(known[generated:generated + self.k])
        return drafts
