"""The only code that touches tensors during a step: prepare inputs, run the target, sample
(verifying drafts), then let the proposer draft the next tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from runtime.config import SamplingParams
from runtime.cpu_kernels import argmax_rows
from runtime.cuda_graphs import DecodeGraphs
from runtime.greedy_head import ExactGreedyHead
from runtime.guided import Guide, apply_guides, guides_allow
from runtime.inputs import PromptRows, SampleRow, StepInputs, prepare_inputs
from runtime.model import CausalLM
from runtime.penalties import hold_eos, penalize
from runtime.sampler import (
    TokenLogprobs,
    make_sampling_tensors,
    position_uniforms,
    target_probs,
    token_logprobs,
)
from runtime.scheduler import SchedulerOutput
from runtime.speculative.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    greedy_verify,
    sample_and_verify,
)
from runtime.token_bias import apply_token_bias

# prompt rows whose logits are computed at once (SamplingParams.prompt_logprobs)
PROMPT_LOGITS_ROWS = 256


class RunnerOutput(NamedTuple):
    emitted: list[list[int] | None]  # per scheduled seq: tokens to append (None: no sample)
    num_drafts_verified: list[int]  # per scheduled seq: draft tokens verified this step
    drafts: list[list[int]]  # per scheduled seq: proposals for the next step ([] without drafter)
    # per scheduled seq: the emitted tokens' log-probabilities, where its params ask for them
    logprobs: list[TokenLogprobs | None]
    # per scheduled seq: its prompt chunk's log-probabilities, where its params ask for them
    prompt_logprobs: list[list[float] | None]


class Proposer(Protocol):
    aux_layer_ids: tuple[int, ...]

    def propose(self, step: StepInputs, out: SchedulerOutput, features: torch.Tensor,
                emitted: list[list[int] | None], verified: list[int]) -> list[list[int]]: ...


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: dict[str, torch.Tensor], block_size: int,
                 device: torch.device, num_speculative_tokens: int,
                 proposer: Proposer | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.proposer = proposer
        self.eos_token_ids = eos_token_ids  # held back from requests short of min_tokens
        # the most drafts a request verifies in a step: the sampler's rows are this + 1 wide
        self.draft_width = num_speculative_tokens if proposer is not None else 0
        # greedy steps: the argmax without the full float32 head, same bits (runtime.greedy_head)
        self.exact_head = ExactGreedyHead.for_head(model.lm_head)
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps, if enabled
        self.guide_for: Callable[[SamplingParams], Guide] = _no_guides  # Engine.guides

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> RunnerOutput:
        step = prepare_inputs(out, block_tables, self.block_size, self.device)
        if self.graphs is not None and self.graphs.applies(step):
            hidden, aux = self.graphs.run(step)
        else:
            metadata = {name: step.metadata for name in self.model.layer_names}
            aux_ids = self.proposer.aux_layer_ids if self.proposer is not None else ()
            hidden, aux = self.model(step.input_ids, step.positions, self.kv_caches, metadata,
                                     aux_ids)
        emitted: list[list[int] | None] = [None] * len(out.scheduled)
        logprobs: list[TokenLogprobs | None] = [None] * len(out.scheduled)
        num_verified = [0] * len(out.scheduled)
        if step.sample_rows:
            tokens, token_logprobs = self._sample(out, step, hidden)  # the step's one host sync
            for row, toks, lps in zip(step.sample_rows, tokens, token_logprobs, strict=True):
                emitted[row.seq_index] = toks
                logprobs[row.seq_index] = lps
                num_verified[row.seq_index] = len(row.draft_token_ids)
        prompt_logprobs: list[list[float] | None] = [None] * len(out.scheduled)
        for chunk in step.prompt_rows:
            prompt_logprobs[chunk.seq_index] = self._prompt_logprobs(hidden, chunk)
        drafts: list[list[int]] = [[] for _ in out.scheduled]
        if self.proposer is not None:
            features = torch.cat(aux, dim=-1) if aux else hidden
            drafts = self.proposer.propose(step, out, features, emitted, num_verified)
        return RunnerOutput(emitted, num_verified, drafts, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor,  # [num_tokens, hidden_size]
                         chunk: PromptRows) -> list[float]:
        """The log-softmax of each row's logits at the prompt token after it, a slice of rows at
        a time (a whole chunk's logits would be rows x vocabulary floats at once). A row's
        logits do not depend on the other rows: the same bits however the prompt is cut."""
        values: list[float] = []
        for at in range(0, len(chunk.rows), PROMPT_LOGITS_ROWS):
            rows = torch.tensor(chunk.rows[at:at + PROMPT_LOGITS_ROWS], device=self.device)
            tokens = torch.tensor(chunk.next_tokens[at:at + PROMPT_LOGITS_ROWS],
                                  device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            values += torch.log_softmax(logits, dim=-1).gather(
                1, tokens.unsqueeze(1)).squeeze(1).tolist()
        return values

    def _sample(self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor
                ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Each sampling request's emitted tokens, and their log-probabilities where its params
        ask for them."""
        rows = step.sample_rows
        width = self.draft_width
        # The LM head runs on each request's real rows only (fewer than width + 1 when it has
        # fewer drafts); `padded` lays them out as [batch, width + 1], repeating a row's last one.
        real = [i for r in rows for i in r.logits_rows]
        padded, start = [], 0
        for r in rows:
            n = len(r.logits_rows)
            padded += [start + min(j, n - 1) for j in range(width + 1)]
            start += n
        selected = hidden.index_select(0, torch.tensor(real, device=self.device))
        padded_index = torch.tensor(padded, device=self.device)
        seqs = [out.scheduled[r.seq_index].seq for r in rows]
        drafts = torch.tensor([_pad(r, width) for r in rows], dtype=torch.int64,
                              device=self.device).view(len(rows), width)
        num_drafts = torch.tensor([len(r.draft_token_ids) for r in rows], device=self.device)
        # logits changed by allowed_token_ids or logit_bias, and those that depend on the
        # tokens so far: penalties, EOS held back by min_tokens
        biased = any(s.params.biased for s in seqs)
        guided = any(s.params.guided for s in seqs)
        penalized = any(s.params.penalized for s in seqs)
        held = any(s.num_output_tokens < s.params.min_tokens
                   and (self.eos_token_ids or s.params.stop_token_ids) for s in seqs)
        changed = biased or guided or penalized or held
        want_logprobs = any(s.params.wants_logprobs for s in seqs)
        all_greedy = all(s.params.greedy for s in seqs)
        verified = [r.draft_token_ids for r in rows]
        if all_greedy and not (biased or penalized or held or want_logprobs):
            best = (self.exact_head.argmax(selected) if self.exact_head is not None
                    else argmax_rows(self.model.compute_logits(selected)))
            # a guided row whose argmax its guide allows has that token after masking too
            if not guided or guides_allow(best.tolist(), seqs, verified, self.guide_for):
                argmax = best.index_select(0, padded_index).view(len(rows), width + 1)
                return _emitted(greedy_verify(drafts, num_drafts, argmax)), [None] * len(rows)
        logits = self.model.compute_logits(selected).float()
        raw = logits.clone() if changed and want_logprobs else logits
        if biased:  # vLLM's order: allowed ids, min_tokens, logit_bias, then penalties
            apply_token_bias(logits, seqs, [len(r.logits_rows) for r in rows])
        if held:
            hold_eos(logits, seqs, verified, self.eos_token_ids)
        if penalized:
            penalize(logits, seqs, verified)
        if guided:  # last: -inf commutes with each of those; greedy rows masked only if needed
            apply_guides(logits, seqs, verified, self.guide_for, all_greedy)
        if all_greedy:
            argmax = argmax_rows(logits).index_select(0, padded_index).view(len(rows), width + 1)
            tokens = _emitted(greedy_verify(drafts, num_drafts, argmax))
        else:
            st = make_sampling_tensors([s.params.temperature for s in seqs],
                                       [s.params.top_k for s in seqs],
                                       [s.params.top_p for s in seqs], self.device,
                                       [s.params.min_p for s in seqs])
            probs = target_probs(logits.index_select(0, padded_index), st, width + 1)
            # each emitted token's uniform, keyed by its index in the sequence
            uniforms = position_uniforms([s.params.seed for s in seqs],
                                         [len(s.token_ids) for s in seqs], width + 1, self.device)
            tokens = _emitted(sample_and_verify(drafts, num_drafts, probs, st.greedy, uniforms))
        if not want_logprobs:
            return tokens, [None] * len(rows)
        return tokens, token_logprobs(raw, [len(r.logits_rows) for r in rows], tokens,
                                      [s.params.top_logprobs if s.params.wants_logprobs else None
                                       for s in seqs])


def _no_guides(params: SamplingParams) -> Guide:
    raise RuntimeError("this runner was built without guided decoding (Engine sets guide_for)")


def _emitted(sampled: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in sampled.tolist()]


def _pad(row: SampleRow, width: int) -> list[int]:
    return row.draft_token_ids + [0] * (width - len(row.draft_token_ids))
