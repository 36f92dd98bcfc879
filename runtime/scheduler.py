"""Continuous batching with one rule, and no tensors.

Each step, every running request's computed tokens catch up with its tokens plus its draft tokens,
within the token budget. That one rule is prefill, chunked prefill (the budget cuts a prompt), a
prefix-cache hit (computed tokens start past the hit), decode (one token behind) and verification
(one token plus k drafts behind). When the KV cache cannot hold a running request's next tokens,
the newest running request is preempted: its blocks are freed and it is recomputed later from its
prompt and the outputs it already has, so nothing is lost. A request alone in the cache that fits
only without its drafts and the slots a drafter writes ahead runs that step without them
(Sequence.may_draft), so drafting never makes a request fail that plain decoding would finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from runtime.kv.manager import ComputedBlocks, KVCacheManager
from runtime.sequence import Sequence, Status


class ScheduledSeq(NamedTuple):
    seq: Sequence
    start: int  # num_computed_tokens before this step: the first position fed
    num_new_tokens: int  # tokens fed this step: from (token_ids + draft_token_ids)[start:]


@dataclass(frozen=True)
class SchedulerOutput:
    """The only message from scheduler to runner."""

    scheduled: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # a request's first position whose KV is not complete yet (a drafter's rows still
        # waiting to be written), or None; and what to call once its blocks are freed
        self.incomplete_from: Callable[[str], int | None] = lambda request_id: None
        self.released: Callable[[str], None] = lambda request_id: None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Mutates: allocates KV blocks, moves requests between waiting and running, preempts."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._allocate_or_preempt(seq, budget, preempted)
            if num_new is None:
                break  # seq itself was the newest and got preempted
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), self.max_num_batched_tokens - budget,
                               tuple(preempted))

    def _allocate_or_preempt(self, seq: Sequence, budget: int, preempted: list[str]
                             ) -> int | None:
        """The tokens seq feeds this step, once its slots are allocated (preempting the newest
        requests while they do not fit), or None where seq itself was preempted."""
        seq.may_draft = True
        num_new = min(seq.num_tokens_with_drafts - seq.num_computed_tokens, budget)
        complete = self._complete(seq, seq.num_computed_tokens)
        while self.kv.allocate_slots(seq.request_id, seq.token_ids, seq.num_computed_tokens,
                                     num_new, self.num_lookahead_tokens,
                                     num_complete=complete) is None:
            if self.running == [seq] and (seq.draft_token_ids or self.num_lookahead_tokens):
                # alone at the edge of the cache: without drafts the step may still fit
                bare = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                if self.kv.allocate_slots(seq.request_id, seq.token_ids, seq.num_computed_tokens,
                                          bare, 0, num_complete=complete) is not None:
                    seq.draft_token_ids = []
                    seq.may_draft = False
                    return bare
            victim = self.running.pop()
            self._free(victim)
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            preempted.append(victim.request_id)
            if victim is seq:
                return None
        return num_new

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = (ComputedBlocks([], 0) if seq.needs_prompt_logprobs
                   else self.kv.get_computed_blocks(seq.token_ids))
            num_new = min(len(seq.token_ids) - hit.num_tokens, budget)
            complete = self._complete(seq, hit.num_tokens)
            seq.may_draft = True
            blocks = self.kv.allocate_slots(seq.request_id, seq.token_ids, hit.num_tokens,
                                            num_new, self.num_lookahead_tokens, hit.block_ids,
                                            complete)
            if blocks is None and not self.running and self.num_lookahead_tokens:
                # alone in the cache: without the slots a drafter writes ahead it may fit
                seq.may_draft = False
                blocks = self.kv.allocate_slots(seq.request_id, seq.token_ids, hit.num_tokens,
                                                num_new, 0, hit.block_ids, complete)
            if blocks is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = hit.num_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        return budget

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mutates: frees the request's blocks and drops it from running/waiting."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _complete(self, seq: Sequence, start: int) -> int | None:
        """Where the request's KV may stop being complete when requests admitted in this pass
        read it (None: it will be complete): rows still waiting to be written, and those fed
        this step from `start` on unless they start inside the prompt (a drafter writes a prompt
        chunk's rows in its step; it may leave others for a later step)."""
        pending = self.incomplete_from(seq.request_id)
        if start < seq.num_prompt_tokens:
            return pending
        return start if pending is None else min(pending, start)

    def _free(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id, seq.token_ids, self.incomplete_from(seq.request_id))
        self.released(seq.request_id)
