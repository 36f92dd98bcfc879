"""Scheduler with a real KVCacheManager and hand-built Sequences: exact (start, num_new) per step,
exact block ids. No model: `_step` plays the engine's postprocess (a fixed next token)."""

from __future__ import annotations

from runtime.config import SamplingParams
from runtime.kv.manager import KVCacheManager
from runtime.scheduler import Scheduler, SchedulerOutput
from runtime.sequence import Sequence, Status

BLOCK_SIZE = 4
NEXT_TOKEN = 99


def _seq(request_id: str, num_prompt_tokens: int, first_token: int = 0,
         arrival: int = 0) -> Sequence:
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Sequence(request_id, prompt, SamplingParams(), arrival, num_speculative_tokens=1)


def _scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64,
               prefix_caching: bool = False) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs,
                     budget, num_lookahead_tokens=0)


def _step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[tuple[str, int, int]]]:
    """Schedule, then advance computed tokens and append NEXT_TOKEN to every request whose
    last token was fed (as the engine does without a drafter)."""
    out = scheduler.schedule()
    for seq, start, n in out.scheduled:
        seq.num_computed_tokens = start + n
        if start + n >= len(seq.token_ids):
            seq.token_ids.append(NEXT_TOKEN)
    return out, [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_under_a_token_budget() -> None:
    sched = _scheduler(num_blocks=16, budget=8)
    a, b = _seq("A", 10), _seq("B", 5, first_token=50)
    sched.add(a)
    sched.add(b)

    out, steps = _step(sched)  # A's first chunk takes the whole budget; B waits
    assert steps == [("A", 0, 8)]
    assert out.num_batched_tokens == 8
    assert a.num_output_tokens == 0 and list(sched.waiting) == [b]
    assert sched.kv.block_ids("A") == [1, 2]

    out, steps = _step(sched)  # A finishes its prompt (2 tokens), B's prompt fits in the rest
    assert steps == [("A", 8, 2), ("B", 0, 5)]
    assert out.num_batched_tokens == 7
    assert sched.kv.block_ids("A") == [1, 2, 3]
    assert sched.kv.block_ids("B") == [4, 5]
    assert a.token_ids[-1] == NEXT_TOKEN and b.token_ids[-1] == NEXT_TOKEN

    _, steps = _step(sched)  # both decode
    assert steps == [("A", 10, 1), ("B", 5, 1)]


def test_budget_cuts_the_second_prompt() -> None:
    sched = _scheduler(num_blocks=16, budget=6)
    for seq in (_seq("A", 4), _seq("B", 7, first_token=50)):
        sched.add(seq)
    out, steps = _step(sched)
    assert steps == [("A", 0, 4), ("B", 0, 2)]
    assert out.num_batched_tokens == 6
    assert sched.kv.block_ids("B") == [2]  # only the slots fed this step are allocated
    _, steps = _step(sched)
    assert steps == [("A", 4, 1), ("B", 2, 5)]
    assert sched.kv.block_ids("A") == [1, 3]  # A is scheduled first, so it takes block 3
    assert sched.kv.block_ids("B") == [2, 4]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = _scheduler(num_blocks=16, max_num_seqs=2)
    seqs = [_seq(name, 3, first_token=10 * i) for i, name in enumerate("ABC")]
    for seq in seqs:
        sched.add(seq)
    _, steps = _step(sched)
    assert steps == [("A", 0, 3), ("B", 0, 3)]
    assert seqs[2].status is Status.WAITING
    _, steps = _step(sched)
    assert steps == [("A", 3, 1), ("B", 3, 1)]

    sched.finish(seqs[0], "length")
    assert seqs[0].status is Status.FINISHED and seqs[0].finish_reason == "length"
    _, steps = _step(sched)  # A's place goes to C
    assert steps == [("B", 4, 1), ("C", 0, 3)]
    # A's block 1 went to the tail of the free queue; B's 5th slot takes block 3 and C the
    # next least recently used one
    assert sched.kv.block_ids("B") == [2, 3]
    assert sched.kv.block_ids("C") == [4]
    assert sched.kv.pool.free_queue_ids()[-1] == 1
    assert sched.num_unfinished == 2


def test_decode_steps_grow_the_block_table_at_block_boundaries() -> None:
    sched = _scheduler(num_blocks=16)
    a = _seq("A", 3)
    sched.add(a)
    tables = []
    for _ in range(7):
        _, steps = _step(sched)
        tables.append(sched.kv.block_ids("A"))
    assert steps == [("A", 8, 1)]
    # slots needed after each step: 3, 4, 5, ..., 9 -> blocks 1, 1, 2, 2, 2, 2, 3
    assert [len(t) for t in tables] == [1, 1, 2, 2, 2, 2, 3]
    assert tables[-1] == [1, 2, 3]
    assert a.token_ids == [0, 1, 2] + [NEXT_TOKEN] * 7


def test_the_newest_request_is_preempted_and_readmitted_later() -> None:
    # 4 usable blocks (1..4); A and B each grow to 2 blocks, then A needs a third.
    sched = _scheduler(num_blocks=5)
    a, b = _seq("A", 4), _seq("B", 4, first_token=50, arrival=1)
    sched.add(a)
    sched.add(b)
    for _ in range(5):  # prompts, then decode until both hold 8 computed tokens
        out, steps = _step(sched)
        assert out.preempted == ()
    assert steps == [("A", 7, 1), ("B", 7, 1)]
    assert sched.kv.block_ids("A") == [1, 3]
    assert sched.kv.block_ids("B") == [2, 4]
    assert sched.kv.num_free_blocks == 0

    out, steps = _step(sched)  # A's 9th slot needs a block: B (newest) gives back [2, 4]
    assert out.preempted == ("B",)
    assert steps == [("A", 8, 1)]
    assert sched.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]
    # B's blocks were freed tail first (4, then 2); A took the head of the free queue
    assert sched.kv.block_ids("A") == [1, 3, 4]
    assert sched.kv.pool.free_queue_ids() == [2]
    # nothing is lost: B keeps its prompt and the 5 tokens it generated
    assert b.token_ids == [50, 51, 52, 53] + [NEXT_TOKEN] * 5

    _, steps = _step(sched)  # B needs 3 blocks for its 9 tokens; only 1 is free
    assert steps == [("A", 9, 1)]

    sched.finish(a, "length")
    assert sched.kv.pool.free_queue_ids() == [2, 4, 3, 1]
    out, steps = _step(sched)  # B is recomputed from its prompt and outputs
    assert steps == [("B", 0, 9)]
    assert sched.kv.block_ids("B") == [2, 4, 3]
    assert b.token_ids == [50, 51, 52, 53] + [NEXT_TOKEN] * 6


def test_a_request_that_cannot_grow_preempts_itself_when_newest() -> None:
    # 3 usable blocks: A (5 tokens) holds [1, 2], B (4 tokens) holds [3].
    sched = _scheduler(num_blocks=4)
    a, b = _seq("A", 5), _seq("B", 4, first_token=50, arrival=1)
    sched.add(a)
    sched.add(b)
    _, steps = _step(sched)
    assert steps == [("A", 0, 5), ("B", 0, 4)]
    assert sched.kv.block_ids("A") == [1, 2]
    assert sched.kv.block_ids("B") == [3]

    out, steps = _step(sched)  # B's 5th slot needs a block: B is the newest, so B goes
    assert out.preempted == ("B",)
    assert steps == [("A", 5, 1)]
    assert sched.kv.pool.free_queue_ids() == [3]
    assert b.token_ids == [50, 51, 52, 53, NEXT_TOKEN]


def test_prefix_cache_hit_starts_past_the_cached_blocks() -> None:
    sched = _scheduler(num_blocks=16, prefix_caching=True)
    a = _seq("A", 9)
    sched.add(a)
    _step(sched)
    assert sched.kv.block_ids("A") == [1, 2, 3]
    sched.finish(a, "stop")

    b = Sequence("B", list(range(8)) + [70, 71], SamplingParams(), 1, 1)  # shares 2 blocks
    sched.add(b)
    _, steps = _step(sched)
    assert steps == [("B", 8, 2)]
    # hits [1, 2]; the new block is the least recently used free one (A's 3 was freed last)
    assert sched.kv.block_ids("B") == [1, 2, 4]
    assert sched.kv.hits_tokens == 8


def test_with_a_drafter_a_pass_does_not_lend_blocks_fed_past_the_prompt_in_it() -> None:
    """A drafter writes a prompt chunk's rows in its step but may leave those of generated
    tokens (fed again after a preemption, or decoded) for a later one: a request admitted in
    the same pass takes no block whose rows are fed this step past the prompt."""
    kv = KVCacheManager(16, BLOCK_SIZE, True, match_next_token=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, num_lookahead_tokens=0)
    earlier = _seq("P", 5)
    earlier.token_ids[4] = 50
    sched.add(earlier)
    _step(sched)
    sched.finish(earlier, "stop")  # its first block stays cached, 50 after it
    first = _seq("R", 4)
    first.token_ids += [50, 51, 52, 53, 54, 55, 56, 57, 58]  # 9 outputs, recomputed
    sched.add(first)
    sched.add(Sequence("W", list(first.token_ids) + [70, 71], SamplingParams(), 1, 1))
    _, steps = _step(sched)
    # R takes P's block and is fed from position 4, past its prompt: W gets that block only
    assert steps == [("R", 4, 9), ("W", 4, 11)]
    assert kv.hits_tokens == 4 + 4
    sched.add(Sequence("X", list(first.token_ids[:13]) + [70, 72], SamplingParams(), 2, 1))
    _step(sched)  # R's rows of the last step are complete now (no drafter rows wait here)
    assert kv.hits_tokens == 4 + 4 + 12
