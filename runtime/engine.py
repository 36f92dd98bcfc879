"""The engine: schedule -> run -> postprocess, until every request has finished."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain

import torch
from transformers import PretrainedConfig

from runtime.config import EngineConfig, SamplingParams
from runtime.cuda_graphs import DecodeGraphs
from runtime.guided import Guides
from runtime.host_memory import keep_step_buffers, return_freed_memory
from runtime.kv.manager import KVCacheManager
from runtime.loader import (
    eos_token_ids,
    load_model_config,
    load_tokenizer,
    resolve_model,
    unapplied_generation_config,
)
from runtime.model import CausalLM, layer_windows
from runtime.model_runner import ModelRunner, RunnerOutput
from runtime.request import Completion, GenerationRequest
from runtime.rope import context_length
from runtime.scheduler import Scheduler, SchedulerOutput
from runtime.sequence import Sequence
from runtime.setup import (
    Placement,
    build_kv_cache,
    build_model,
    kv_budget,
    place,
    target_specs,
)
from runtime.stop import StopChecker


class Engine:
    """Built once per job from a frozen EngineConfig.

    Attributes the pipeline uses: tokenizer (chat_template set when the model has one),
    eos_token_ids, max_model_len (model_context unless set), model_name, drafter_name,
    unapplied_generation_config.
    """

    def __init__(self, config: EngineConfig, target: CausalLM | None = None) -> None:
        """target: the model of another Engine over the same checkpoint, dtype, device,
        attention backend and q4_panels setting, built for at least as many positions, to run
        on the same weights (a bench holds several variants at once: one copy of the weights
        instead of one each)."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide, like OMP_NUM_THREADS
        self.placement = p = place(config)
        model_dir = resolve_model(config.model)
        self.model_name = config.model
        self.hf_config = load_model_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        self.unapplied_generation_config = unapplied_generation_config(model_dir)
        self.model_context = context_length(self.hf_config)
        self.vocab_size: int = self.hf_config.vocab_size
        self.max_model_len = config.max_model_len or self.model_context
        k = config.draft_width  # drafts verified per request and step, at most
        positions = self.max_model_len + 2 * k + 2
        if target is None:
            self.model = build_model(model_dir, self.hf_config, p, positions,
                                     config.q4_panels)
        else:
            _check_shared_target(target, self.hf_config, p, positions, config.q4_panels)
            self.model = target
        specs = target_specs(self.hf_config, self.model, p, self.max_model_len)
        self.proposer = None
        self.drafter_name: str | None = None
        draft_names: list[str] = []
        if config.drafter is not None:
            from runtime.speculative.setup import build_proposer  # noqa: PLC0415
            self.proposer, draft_specs = build_proposer(config, self.model, p,
                                                        self.max_model_len + 2 * k + 2)
            specs.update(draft_specs)
            draft_names = list(draft_specs)
            self.drafter_name = config.drafter
        self.kv_cache_config, caches = build_kv_cache(specs, draft_names, kv_budget(config, p), p)
        if self.proposer is not None:
            self.proposer.bind(caches, p.block_size)
        self.kv = KVCacheManager(self.kv_cache_config.num_blocks, p.block_size,
                                 config.enable_prefix_caching,
                                 match_next_token=self.proposer is not None)
        lookahead = k if self.proposer is not None else 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead)
        if self.proposer is not None:
            self.scheduler.incomplete_from = self.proposer.unwritten_from
            self.scheduler.released = self.proposer.release
        self.runner = ModelRunner(self.model, caches, p.block_size, p.device, k, self.proposer,
                                  self.eos_token_ids)
        self.guides = Guides(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.runner.guide_for = self.guides.for_params
        if config.cuda_graphs:
            self.runner.graphs = decode_graphs(self, caches)
        if p.device.type == "cpu":
            return_freed_memory()  # the build's temporaries (the exact greedy head's, ...)
            # only now: the build's large tensors came from (and went back to) their own
            # mappings, not a heap that keeps what it frees (a 16 GB model's build doubled)
            keep_step_buffers()
        self.stop = StopChecker(self.tokenizer, self.eos_token_ids)
        self._arrivals = 0

    def draft_from_reference(self, reference: Mapping[str, tuple[int, ...]]) -> None:
        """From now on, a request whose id is in `reference` is drafted the next tokens of its
        reference output instead of the drafter's proposals; the drafter still runs, so steps
        cost the same (runtime.speculative.reference: the ceiling of speculation)."""
        if self.proposer is None:
            raise ValueError("drafting from reference outputs needs an engine with a drafter")
        from runtime.speculative.reference import ReferenceDrafts  # noqa: PLC0415

        self.runner.proposer = ReferenceDrafts(self.proposer, self.config.num_speculative_tokens,
                                               reference)

    def generate(
        self,
        requests: Iterable[GenerationRequest],
        on_step: Callable[[int], None] | None = None,
    ) -> Iterator[Completion]:
        """Pull requests lazily from `requests` (only as many as keep the batch full), yield each
        Completion as soon as it finishes (not in input order). on_step(n) is called after each
        engine step with the number of tokens generated in that step."""
        pending = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(self.scheduler.waiting) < self.config.max_num_seqs:
                    request = next(pending, None)
                    if request is None:
                        exhausted = True
                    elif (error := self._admission_error(request)) is not None:
                        yield _error_completion(request, error)
                    else:
                        self.scheduler.add(self._new_sequence(request))
                if self.scheduler.num_unfinished == 0:
                    return
                yield from self.step(on_step)
        finally:
            self.abort_all()  # the caller stopped early (or raised): leave the engine reusable

    def abort_all(self) -> int:
        """Drops every unfinished request and frees its KV blocks; returns how many."""
        unfinished = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in unfinished:
            self.scheduler.finish(seq, "abort")
        return len(unfinished)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (between requests only; see KVCacheManager): the next
        requests share only what they share with each other. The number of blocks forgotten."""
        return self.kv.reset_prefix_cache()

    def step(self, on_step: Callable[[int], None] | None = None) -> list[Completion]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return [self._unschedulable()]
        block_tables = [self.kv.block_ids(s.seq.request_id) for s in out.scheduled]
        result = self.runner.execute(out, block_tables)
        finished, generated = self._postprocess(out, result)
        if on_step is not None:
            on_step(generated)
        return finished

    def guided_problem(self, params: SamplingParams) -> str | None:
        """Why requests guided by these params cannot run here (runtime.guided), or None."""
        return self.guides.problem(params)

    def _admission_error(self, request: GenerationRequest) -> str | None:
        n = len(request.prompt_token_ids)
        if n == 0:
            return "empty prompt (no tokens)"
        if any(seq.request_id == request.request_id
               for seq in chain(self.scheduler.running, self.scheduler.waiting)):
            # its KV blocks and drafts are kept by id: two of one id would share them
            return (f"request id {request.request_id!r} is already in flight; ids must be unique "
                    "among the requests running at once")
        if n >= self.max_model_len:
            return (f"prompt has {n} tokens; the model's context is {self.max_model_len} "
                    "tokens and at least one must be left to generate")
        ids, vocab = request.prompt_token_ids, self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # the embedding would fail the whole step
            bad = next(t for t in ids if not 0 <= t < vocab)
            return (f"prompt token id {bad} is outside the model's vocabulary (ids 0 to "
                    f"{vocab - 1}" + ("; a tokenizer with tokens added beyond the model's "
                                      "vocab_size makes them)" if bad >= vocab else ")"))
        params = request.params
        for what, listed in (("stop token id", params.stop_token_ids),
                             ("allowed token id", params.allowed_token_ids),
                             ("logit_bias token id", [t for t, _ in params.logit_bias])):
            if outside := [t for t in listed if t >= vocab]:
                return (f"{what} {outside[0]} is outside the model's vocabulary (ids 0 to "
                        f"{vocab - 1})")
        if params.guided and (why := self.guided_problem(params)):
            return why
        if -(-n // self.placement.block_size) > self.kv_cache_config.num_blocks - 1:
            # its prompt alone outgrows the cache: failed now, not after preempting the others
            return self._too_large(n, request.params.max_tokens)
        return None

    def _too_large(self, num_prompt_tokens: int, max_tokens: int) -> str:
        # what finishing it takes: a slot for every token of the prompt and the completion but
        # the last, which is never fed (alone in the cache, a request runs without drafts where
        # they do not fit)
        tokens = min(num_prompt_tokens + max_tokens, self.max_model_len)
        need = -(-(tokens - 1) // self.placement.block_size)
        return (f"request needs up to {need} KV cache blocks of {self.placement.block_size} "
                f"tokens to finish ({tokens} tokens of prompt and completion) but the whole "
                f"cache has {self.kv_cache_config.num_blocks - 1}; raise --kv-cache-memory")

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.params,
                       self._arrivals,
                       self.config.num_speculative_tokens if self.proposer is not None else 0)
        self._arrivals += 1
        return seq

    def _unschedulable(self) -> Completion:
        """Nothing could be scheduled with nothing running: the head request can never fit."""
        seq = self.scheduler.waiting[0]
        self.scheduler.finish(seq, "error")
        return _completion(seq, error=self._too_large(seq.num_prompt_tokens, seq.params.max_tokens))

    def _postprocess(self, out: SchedulerOutput, result: RunnerOutput
                     ) -> tuple[list[Completion], int]:
        finished: list[Completion] = []
        generated = 0
        for (seq, start, n), emitted, logprobs, verified, drafts, prompt_logprobs in zip(
                out.scheduled, result.emitted, result.logprobs, result.num_drafts_verified,
                result.drafts, result.prompt_logprobs, strict=True):
            if prompt_logprobs is not None:
                seq.prompt_logprobs += prompt_logprobs
            if emitted is None:  # a prefill chunk that did not reach the end of the prompt
                seq.num_computed_tokens = start + n
                continue
            accepted = len(emitted) - 1
            # start + n = len(token_ids) + verified; the rejected drafts' KV is not kept
            seq.num_computed_tokens = start + n - verified + accepted
            reason, kept = self._append(seq, emitted)
            if logprobs is not None:
                seq.output_logprobs += logprobs.values[:kept]
                if logprobs.top is not None:
                    seq.output_top_logprobs += logprobs.top[:kept]
            generated += kept
            if verified:
                # accepted drafts after the token that finished the request (a stop string,
                # EOS) are thrown away with it: they count as neither accepted nor output
                accepted = min(accepted, kept)
                seq.num_draft_steps += 1
                seq.num_drafted += verified
                seq.num_accepted += accepted
                counts = seq.accepted_per_position  # k long; longer lookups add positions
                counts.extend([0] * (accepted - len(counts)))
                for j in range(accepted):
                    counts[j] += 1
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(_completion(seq))
            else:
                seq.draft_token_ids = drafts[:self._draft_room(seq)]
        return finished, generated

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[str | None, int]:
        """Appends tokens until one finishes the request; returns the finish reason (None
        while the request goes on) and how many tokens were appended."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            reason = self.stop.check(seq, self.max_model_len)
            if reason is not None:
                return reason, i + 1
        return None, len(tokens)

    def _draft_room(self, seq: Sequence) -> int:
        """Drafts worth verifying: the request needs at most `left` more tokens, and the last
        of them comes from the target, not a draft."""
        left = min(seq.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - len(seq.token_ids))
        return max(0, left - 1)


def _completion(seq: Sequence, error: str | None = None) -> Completion:
    if error is not None:  # no tokens, as every other request that could not run
        return Completion(seq.request_id, tuple(seq.token_ids[:seq.num_prompt_tokens]), (),
                          "error", error=error)
    return Completion(
        request_id=seq.request_id,
        prompt_token_ids=tuple(seq.token_ids[:seq.num_prompt_tokens]),
        token_ids=tuple(seq.output_token_ids),
        finish_reason=seq.finish_reason or "error",
        stop_string=seq.stop_string,
        stop_held_tokens=seq.params.min_tokens if seq.stop_string is not None else 0,
        num_drafted=seq.num_drafted,
        num_accepted=seq.num_accepted,
        num_draft_steps=seq.num_draft_steps,
        accepted_per_position=tuple(seq.accepted_per_position),
        logprobs=tuple(seq.output_logprobs) if seq.params.logprobs else None,
        top_logprobs=tuple(seq.output_top_logprobs) if seq.params.top_logprobs else None,
        prompt_logprobs=tuple(seq.prompt_logprobs) if seq.params.prompt_logprobs else None,
    )


def _error_completion(request: GenerationRequest, error: str) -> Completion:
    return Completion(request.request_id, tuple(request.prompt_token_ids), (), "error",
                      error=error)


def _check_shared_target(target: CausalLM, hf_config: PretrainedConfig, p: Placement,
                         positions: int, q4_panels: bool) -> None:
    weight = target.model.embed_tokens.weight
    if target.config.to_dict() != hf_config.to_dict():
        raise ValueError("the shared target model was built from another checkpoint")
    if weight.dtype != p.dtype or weight.device.type != p.device.type:
        raise ValueError(f"the shared target model is {weight.dtype} on {weight.device.type}, "
                         f"this engine runs {p.dtype} on {p.device.type}")
    if target.rope.cos.shape[0] < positions:
        raise ValueError(f"the shared target model has rotary tables for "
                         f"{target.rope.cos.shape[0]} positions, this engine needs {positions}")
    if target.q4_panels != q4_panels:
        raise ValueError(f"the shared target model was built with q4_panels={target.q4_panels}, "
                         f"this engine has q4_panels={q4_panels}")


def decode_graphs(engine: Engine, caches: dict[str, torch.Tensor]) -> DecodeGraphs:
    """The engine's CUDA graphs of decode steps (EngineConfig.cuda_graphs); ValueError where
    they cannot run (the device and attention backend they need, place() checks)."""
    p = engine.placement
    if any(w is not None for w in layer_windows(engine.hf_config, engine.max_model_len)):
        raise ValueError("--cuda-graphs does not support sliding-window attention yet")
    aux = engine.proposer.aux_layer_ids if engine.proposer is not None else ()
    return DecodeGraphs(engine.model, caches, p.block_size, engine.config.max_num_seqs,
                        -(-engine.max_model_len // p.block_size), aux)
