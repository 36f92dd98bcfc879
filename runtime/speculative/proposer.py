"""k draft steps per engine step, with ONE attention-metadata object per draft step.

Step 1 runs the drafter over every position the target verified this step (for a prefill chunk,
all of its positions, so the drafter's KV stays complete), pairing the target's feature at
position p with the token at p + 1. Steps 2..k feed one token per sampling request: the previous
draft token with the drafter's own previous output as feature, one position further on.

Worked example (k = 3): a request had token_ids t0..t9 (10 tokens, 9 computed) and drafts
[d0, d1, d2]; the target fed t9, d0, d1, d2 at positions 9..12, accepted d0 and d1 and emitted
[d0, d1, x]. Verified positions are 9, 10, 11 (t9, d0, d1); the tokens after them are d0, d1, x.
    step 1: positions [9, 10, 11], input ids [d0, d1, x], features = target rows of 9, 10, 11
            -> draft token a from the row of position 11
    step 2: position [12], input id [a] -> b;   step 3: position [13], input id [b] -> c
Rejected d2's KV (position 12) is overwritten by step 2 here and by the target next step; slots
past the computed tokens are never read before they are rewritten.

With n-gram drafts on (EngineConfig.draft_ngram), a request whose last tokens occurred before gets
the tokens that followed them (runtime.speculative.ngram) instead of the drafter's, up to k of
them, or up to draft_ngram_tokens for a greedy request alone in its step (whose drafter drafts are
also continued from the lookup where the text with them appended repeats); the draft head and
steps 2..k run only when some request has no such proposal. Step 1's forward runs as always
(the drafter's KV).

A step that drafts nothing (more greedy requests than max_batch) runs the drafter only over prompt
positions (their blocks may serve later requests through the prefix cache): each other request's
step-1 rows (input ids, target features) are stashed and put in front of its rows in the next step
that drafts it, so the drafter's KV ends up the same, written later. Until then unwritten_from()
tells the KV cache manager where the request's drafter KV stops (no prefix hit ends in or runs
through the blocks past it); a request that finishes or is preempted with rows still stashed
leaves them unwritten, and the blocks holding them leave the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from runtime.attention import AttentionMetadata, build_attention_metadata
from runtime.inputs import StepInputs
from runtime.kv.cache import compute_slot_mapping
from runtime.scheduler import SchedulerOutput
from runtime.speculative.drafter import EagleDrafter
from runtime.speculative.ngram import NgramIndex


class DraftRows(NamedTuple):
    """Step-1 inputs, flattened over all scheduled requests."""

    input_ids: list[int]
    positions: list[int]
    feature_rows: list[int]  # rows of the target's features
    starts: list[int]  # per scheduled request: its first position in this batch
    query_lens: list[int]
    last_rows: list[int]  # per sampling request: its last row in this flat batch
    sampling: list[int]  # indices (into SchedulerOutput.scheduled) of sampling requests


class EagleProposer:
    def __init__(self, drafter: EagleDrafter, num_speculative_tokens: int,
                 aux_layer_ids: tuple[int, ...], device: torch.device,
                 min_confidence: float = 0.0, max_batch: int | None = None,
                 ngram: bool = False, ngram_tokens: int = 0) -> None:
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.ngram = ngram
        # lookup drafts of a greedy request sampling alone in its step (EngineConfig.draft_width)
        self.ngram_tokens = max(ngram_tokens, num_speculative_tokens)
        self.min_confidence = min_confidence
        self.max_batch = max_batch
        # request id -> (first position, input ids, target features) the drafter has not read
        self._stashed: dict[str, tuple[int, list[int], torch.Tensor]] = {}
        self.aux_layer_ids = aux_layer_ids
        self.device = device
        self.layer_names = drafter.layer_names
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.block_size = 0

    def bind(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        """Called once the KV cache exists (after validate_same_kv_cache_group)."""
        self.kv_caches = {name: kv_caches[name] for name in self.layer_names}
        self.block_size = block_size

    def unwritten_from(self, request_id: str) -> int | None:
        """The request's first position whose drafter KV is not written yet (its rows wait in
        the stash), or None when none wait."""
        kept = self._stashed.get(request_id)
        return None if kept is None else kept[0]

    def release(self, request_id: str) -> None:
        """The request's blocks were freed: its stash goes (the rows will not be written)."""
        self._stashed.pop(request_id, None)

    def step_metadata(self, md: AttentionMetadata) -> dict[str, AttentionMetadata]:
        """The one metadata object of a draft step, given to every draft layer."""
        return {name: md for name in self.layer_names}

    @torch.inference_mode()
    def propose(self, step: StepInputs, out: SchedulerOutput, features: torch.Tensor,
                emitted: list[list[int] | None], verified: list[int]) -> list[list[int]]:
        rows = self._first_step_rows(step, out, emitted, verified)
        feats = features.index_select(0, torch.tensor(rows.feature_rows, device=self.device))
        drafts: list[list[int]] = [[] for _ in out.scheduled]
        tables = step.block_tables
        skip = bool(rows.sampling) and self._skip_drafts(out, rows.sampling)
        looked_up = ([] if skip or not rows.sampling
                     else self._ngram_drafts(out, rows.sampling, emitted))
        if self._drafter_idle(skip, looked_up):
            # Prompt positions go to the drafter now: their blocks may be reused by the prefix
            # cache, drafter KV included, after this request is gone. The rest waits.
            prompt = [i for i, (seq, start, _) in enumerate(out.scheduled)
                      if start < seq.num_prompt_tokens]
            self._stash(out, rows, feats, set(prompt))
            if prompt:
                sub, sub_feats = _select(rows, feats, prompt)
                self._step_one(sub, sub_feats, [tables[i] for i in prompt])
            if not skip:
                for i, lookup in zip(rows.sampling, looked_up, strict=True):
                    drafts[i] = lookup
            return drafts
        rows, feats = self._with_stashed(out, rows, feats)
        hidden, seq_lens = self._step_one(rows, feats, tables)
        rows, looked_up = _may_draft(out, rows, looked_up)
        if not rows.sampling:
            return drafts
        last = torch.tensor(rows.last_rows, device=self.device)
        hidden = hidden.index_select(0, last)  # [num_sampling, H]
        # The chain's probability ends the draft steps once every request's is below the gate;
        # it also cuts the drafts to verify, except for a request alone in its step (there
        # verifying a few more rows costs next to nothing, another draft step does not)
        confident = self.min_confidence > 0
        gated = confident and not self._alone_and_greedy(out, rows.sampling)
        tokens, chain = self.drafter.draft_with_confidence(hidden, confident)  # [num_sampling]
        steps, chains = [tokens], [chain]
        positions = [rows.positions[r] for r in rows.last_rows]
        lens = [seq_lens[i] for i in rows.sampling]
        sampling_tables = [tables[i] for i in rows.sampling]
        for _ in range(self.k - 1):
            if chain is not None and bool((chain < self.min_confidence).all()):
                break  # every request's drafts end here: no more draft steps
            positions = [p + 1 for p in positions]
            lens = [n + 1 for n in lens]
            slots = [compute_slot_mapping(t, [p], self.block_size)[0]
                     for t, p in zip(sampling_tables, positions, strict=True)]
            md = build_attention_metadata([1] * len(lens), lens, sampling_tables, slots,
                                          self.device)
            hidden = self._run(tokens, positions, hidden, md)
            tokens, prob = self.drafter.draft_with_confidence(hidden, confident)
            if chain is not None and prob is not None:
                chain = chain * prob
            steps.append(tokens)
            chains.append(chain)
        proposals = torch.stack(steps, dim=1).tolist()  # [num_sampling, steps run]
        if gated:  # keep each request's drafts while the chain's probability stays >= the gate
            kept = (torch.stack(chains, dim=1) >= self.min_confidence).sum(1).tolist()  # type: ignore[arg-type]
            proposals = [p[:n] for p, n in zip(proposals, kept, strict=True)]
        longer = self.ngram and self._alone_and_greedy(out, rows.sampling)
        for i, proposal, lookup in zip(rows.sampling, proposals, looked_up, strict=True):
            drafts[i] = lookup or (self._continued(out, i, proposal, emitted) if longer
                                   else proposal)
        return drafts

    def _continued(self, out: SchedulerOutput, i: int, proposal: list[int],
                   emitted: list[list[int] | None]) -> list[int]:
        """The drafter's proposal for a greedy request alone in its step, continued from its
        n-gram lookup where the text with the drafts appended repeats (up to ngram_tokens in
        all): free drafts where verification's extra rows cost nothing (batch 1, k = 2, 8
        prompts: 1.862 -> 1.895 tokens per step)."""
        seq = out.scheduled[i].seq
        if seq.ngram_index is None or len(proposal) >= self.ngram_tokens:
            return proposal
        tokens = seq.token_ids + (emitted[i] or [])
        return proposal + seq.ngram_index.propose_after(tokens, proposal,
                                                        self.ngram_tokens - len(proposal))

    def _ngram_drafts(self, out: SchedulerOutput, sampling: list[int],
                      emitted: list[list[int] | None]) -> list[list[int]]:
        """Per sampling request: its n-gram lookup proposal ([] for none, or n-gram drafts off):
        up to k tokens, or up to ngram_tokens for a greedy request alone in its step (its
        verification reads the weights once for up to a few rows: batch 1, 2 threads, 8 prompts,
        k = 2: 1.74 -> 1.86 tokens per step with lookups of up to 6; see CLI_DRAFT_NGRAM_TOKENS
        for why the default is 3)."""
        if not self.ngram:
            return [[] for _ in sampling]
        longest = self.ngram_tokens if self._alone_and_greedy(out, sampling) else self.k
        drafts = []
        for i in sampling:
            seq = out.scheduled[i].seq
            tokens = seq.token_ids + (emitted[i] or [])
            if seq.ngram_index is None:
                seq.ngram_index = NgramIndex()
            seq.ngram_index.extend(tokens)
            drafts.append(seq.ngram_index.propose(tokens, longest) if seq.may_draft else [])
        return drafts

    def _step_one(self, rows: DraftRows, feats: torch.Tensor, tables: list[list[int]]
                  ) -> tuple[torch.Tensor, list[int]]:
        """Draft step 1 over `rows` (writes the drafter's KV for their positions); returns its
        hidden states and each request's sequence length after it."""
        seq_lens = [p + n for p, n in zip(rows.starts, rows.query_lens, strict=True)]
        slots = [slot for p, n, t in zip(rows.starts, rows.query_lens, tables, strict=True)
                 for slot in compute_slot_mapping(t, range(p, p + n), self.block_size)]
        md = build_attention_metadata(rows.query_lens, seq_lens, tables, slots, self.device)
        return self._run(rows.input_ids, rows.positions, feats, md), seq_lens

    def _stash(self, out: SchedulerOutput, rows: DraftRows, feats: torch.Tensor,
               skip: set[int]) -> None:
        """A step in which the drafter does not draft: instead of running it, keep each
        request's new positions (input ids and target features) for the next step that drafts,
        except the requests in `skip`. A request's stash must end where its next rows start
        (one that does not is stale and dropped); a request not scheduled in this step keeps
        its stash (release() drops it when the request's blocks are freed)."""
        scheduled = {s.seq.request_id for s in out.scheduled}
        stash = {request_id: kept for request_id, kept in self._stashed.items()
                 if request_id not in scheduled}
        for i, start, _, ids, part in _per_request(rows, feats):
            if i in skip:
                continue
            request_id = out.scheduled[i].seq.request_id
            kept = self._stash_ending_at(request_id, start)
            stash[request_id] = ((start, ids, part) if kept is None
                                 else (kept[0], kept[1] + ids, torch.cat([kept[2], part])))
        self._stashed = stash

    def _with_stashed(self, out: SchedulerOutput, rows: DraftRows, feats: torch.Tensor
                      ) -> tuple[DraftRows, torch.Tensor]:
        """rows with each request's stashed positions put in front of its own (the drafter
        writes their KV in this step 1); the stashes of requests not scheduled stay."""
        if not self._stashed:
            return rows, feats
        r = DraftRows([], [], [], [], [], [], rows.sampling)
        pieces: list[torch.Tensor] = []
        for i, start, n, ids, part in _per_request(rows, feats):
            first = start
            kept = self._stash_ending_at(out.scheduled[i].seq.request_id, start)
            if kept is not None:
                first = kept[0]
                r.input_ids.extend(kept[1])
                pieces.append(kept[2])
            r.input_ids.extend(ids)
            pieces.append(part)
            r.positions.extend(range(first, start + n))
            r.starts.append(first)
            r.query_lens.append(start + n - first)
            if i in rows.sampling:
                r.last_rows.append(len(r.input_ids) - 1)
        scheduled = {s.seq.request_id for s in out.scheduled}
        self._stashed = {request_id: kept for request_id, kept in self._stashed.items()
                         if request_id not in scheduled}
        return r, torch.cat(pieces)

    def _stash_ending_at(self, request_id: str, start: int
                         ) -> tuple[int, list[int], torch.Tensor] | None:
        """The request's stash if it ends right before `start` (else it is stale)."""
        kept = self._stashed.get(request_id)
        return kept if kept is not None and kept[0] + len(kept[1]) == start else None

    @staticmethod
    def _alone_and_greedy(out: SchedulerOutput, sampling: list[int]) -> bool:
        """One greedy request samples in this step: its verification reads the weights for one
        row either way, so extra rows cost almost nothing and every draft is worth verifying (no
        confidence cut, only the draft steps end at it; batch 1, 2 threads: 1.51x with the cut
        at 0.15, 1.70x without; at batch 4 the cut still pays: 1.32x against 1.11x), and lookups
        may run past k (up to ngram_tokens). Greedy only: a request that samples keeps the cut
        and k, so its seeded draws do not depend on the batch."""
        return len(sampling) == 1 and out.scheduled[sampling[0]].seq.params.greedy

    @staticmethod
    def _drafter_idle(skip: bool, looked_up: list[list[int]]) -> bool:
        """The drafter does not draft this step (drafts skipped, or every request drafts from
        its n-gram lookup): its step 1 waits for the next step that drafts (same drafts then,
        one drafter forward fewer now: a quarter of batch-1 steps on the example prompts)."""
        return skip or (bool(looked_up) and all(looked_up))

    def _skip_drafts(self, out: SchedulerOutput, sampling: list[int]) -> bool:
        """More requests sample than max_batch. Outputs do not depend on drafting: a greedy
        token is the argmax, a sampled one the target's draw at the uniform its seed and place
        fix, which a draft must equal to be accepted."""
        return self.max_batch is not None and len(sampling) > self.max_batch

    def _run(self, input_ids: list[int] | torch.Tensor, positions: list[int],
             features: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.drafter(ids, pos, features, self.kv_caches, self.step_metadata(md))

    def _first_step_rows(self, step: StepInputs, out: SchedulerOutput,
                         emitted: list[list[int] | None], verified: list[int]) -> DraftRows:
        r = DraftRows([], [], [], [], [], [], [])
        for i, (seq, start, n) in enumerate(out.scheduled):
            new = emitted[i]
            # verified positions: all fed tokens except the rejected drafts
            valid = n if new is None else n - verified[i] + (len(new) - 1)
            tokens = seq.token_ids + (new or [])
            offset = step.metadata.query_starts[i]
            r.input_ids.extend(tokens[start + 1:start + valid + 1])
            r.positions.extend(range(start, start + valid))
            r.feature_rows.extend(range(offset, offset + valid))
            r.starts.append(start)
            r.query_lens.append(valid)
            if new is not None:
                r.last_rows.append(len(r.input_ids) - 1)
                r.sampling.append(i)
        return r


def _may_draft(out: SchedulerOutput, rows: DraftRows, looked_up: list[list[int]]
               ) -> tuple[DraftRows, list[list[int]]]:
    """rows and lookups without the requests that may not draft this step (alone at the edge of
    the KV cache, Sequence.may_draft): their step 1 is written, but the later draft steps would
    write past their slots, and they have no room for drafts."""
    keep = [j for j, i in enumerate(rows.sampling) if out.scheduled[i].seq.may_draft]
    if len(keep) == len(rows.sampling):
        return rows, looked_up
    return (rows._replace(sampling=[rows.sampling[j] for j in keep],
                          last_rows=[rows.last_rows[j] for j in keep]),
            [looked_up[j] for j in keep] if looked_up else looked_up)


def _per_request(rows: DraftRows, feats: torch.Tensor
                 ) -> Iterator[tuple[int, int, int, list[int], torch.Tensor]]:
    """(scheduled index, first position, number of rows, their input ids, their features) of each
    scheduled request in step-1 `rows`."""
    offset = 0
    for i, (start, n) in enumerate(zip(rows.starts, rows.query_lens, strict=True)):
        yield i, start, n, rows.input_ids[offset:offset + n], feats[offset:offset + n]
        offset += n


def _select(rows: DraftRows, feats: torch.Tensor, keep: list[int]
            ) -> tuple[DraftRows, torch.Tensor]:
    """The step-1 rows of the scheduled requests `keep`, without sampling."""
    r = DraftRows([], [], [], [], [], [], [])
    pieces = []
    wanted = set(keep)
    for i, start, n, ids, part in _per_request(rows, feats):
        if i in wanted:
            r.input_ids.extend(ids)
            r.positions.extend(range(start, start + n))
            r.starts.append(start)
            r.query_lens.append(n)
            pieces.append(part)
    return r, torch.cat(pieces)
