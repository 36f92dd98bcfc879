from __future__ import annotations

import pytest
import torch

from runtime.speculative.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    num_accepted,
    rejection_sample,
)

P = PLACEHOLDER_TOKEN_ID

VOCAB = 8
# The target and a deliberately different draft distribution (total variation 0.55).
P_TARGET = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03])
P_DRAFT = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.10, 0.15, 0.25, 0.30])
P_TARGET_2 = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10])


def one_hot_rows(*argmaxes: int) -> torch.Tensor:  # [rows, VOCAB]
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), VOCAB).float()


def greedy_target(argmaxes: list[list[int]]) -> torch.Tensor:  # [batch, k + 1, VOCAB]
    return torch.stack([one_hot_rows(*row) for row in argmaxes])


def sample(
    drafts: list[list[int]],
    num_draft: list[int],
    target: torch.Tensor,
    greedy: list[bool],
    draft_probs: torch.Tensor | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> list[list[int]]:
    out = rejection_sample(
        torch.tensor(drafts, dtype=torch.int64).view(len(drafts), -1),
        torch.tensor(num_draft),
        draft_probs,
        target,
        torch.tensor(greedy),
        generators if generators is not None else [None] * len(drafts),
    )
    assert out.dtype == torch.int64
    return out.tolist()


def tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    empirical = torch.bincount(tokens, minlength=VOCAB).float() / tokens.numel()
    return 0.5 * (empirical - p).abs().sum().item()


# ---- greedy, exact ----------------------------------------------------------------------------

def test_greedy_all_accepted_then_bonus() -> None:
    target = greedy_target([[3, 1, 4, 6]])
    assert sample([[3, 1, 4]], [3], target, [True]) == [[3, 1, 4, 6]]


def test_greedy_first_rejected_emits_recovered_and_stops() -> None:
    target = greedy_target([[3, 1, 4, 6]])
    assert sample([[2, 1, 4]], [3], target, [True]) == [[3, P, P, P]]


def test_greedy_mismatch_in_the_middle() -> None:
    # Position 2 would match again, but verification stops at the first mismatch.
    target = greedy_target([[3, 1, 4, 6]])
    assert sample([[3, 0, 4]], [3], target, [True]) == [[3, 1, P, P]]


def test_zero_draft_tokens_is_plain_greedy_sampling() -> None:
    target = greedy_target([[5], [2]])
    out = rejection_sample(torch.empty(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                           None, target, torch.tensor([True, True]), [None, None])
    assert out.tolist() == [[5], [2]]


def test_mixed_rows_with_different_draft_counts() -> None:
    target = greedy_target([[3, 1, 4, 6], [2, 7, 0, 0], [5, 0, 0, 0], [1, 2, 3, 4]])
    drafts = [[3, 1, 4], [2, P, P], [P, P, P], [1, 5, 3]]
    assert sample(drafts, [3, 1, 0, 2], target, [True] * 4) == [
        [3, 1, 4, 6],  # all accepted + bonus
        [2, 7, P, P],  # its one draft accepted, bonus from row 1
        [5, P, P, P],  # no drafts: plain argmax
        [1, 2, P, P],  # rejected at 1 -> recovered (position 2 matches but is never reached)
    ]


def test_drafts_beyond_num_draft_tokens_are_ignored() -> None:
    # Position 2 holds a token that would match; num_draft_tokens = 2 ends the row at the bonus.
    target = greedy_target([[3, 1, 4, 6]])
    assert sample([[3, 1, 4]], [2], target, [True]) == [[3, 1, 4, P]]
    assert sample([[3, 1, 4]], [2], greedy_target([[3, 1, 7, 6]]), [True]) == [[3, 1, 7, P]]


def test_greedy_row_ignores_draft_probs_and_noise() -> None:
    target = greedy_target([[3, 1, 4]])
    draft_probs = torch.full((1, 2, VOCAB), 1.0 / VOCAB)
    assert sample([[3, 2]], [2], target, [True], draft_probs) == [[3, 1, P]]


# ---- random rows, exact where the probabilities force the outcome ----------------------------

def test_random_row_accepts_where_the_target_agrees_and_rejects_a_zero_probability_token() -> None:
    # Row 0 target is one-hot at the drafts -> always accepted; bonus is forced to 6.
    # Row 1 target gives the draft 0 probability -> always rejected; recovered is forced to 4.
    target = torch.stack([one_hot_rows(3, 1, 6), one_hot_rows(4, 0, 0)])
    draft_probs = torch.stack([one_hot_rows(3, 1), one_hot_rows(2, 1)])
    for _ in range(20):
        assert sample([[3, 1], [2, 1]], [2, 2], target, [False, False], draft_probs) == [
            [3, 1, 6], [4, P, P]]


def test_residual_without_mass_falls_back_to_the_target() -> None:
    # p_t = p_d / 2 (unnormalised input): half the drafts are rejected, and the residual
    # max(0, p_t - p_d) is all zero, so the recovered token comes from p_t: 5 or 6, never 0.
    p_d = torch.zeros(VOCAB)
    p_d[[5, 6]] = 0.5
    target = (p_d / 2).expand(400, 2, VOCAB)
    draft_probs = p_d.expand(400, 1, VOCAB)
    drafts = torch.multinomial(p_d, 400, replacement=True).unsqueeze(-1)
    out = rejection_sample(drafts, torch.ones(400, dtype=torch.int64), draft_probs, target,
                           torch.zeros(400, dtype=torch.bool), [None] * 400)
    assert set(out[:, 0].tolist()) == {5, 6}
    assert 0 < (out[:, 1] == P).sum().item() < 400  # some rows were rejected


# ---- statistical: the first emitted token follows the target ---------------------------------

N = 40_000
TV_BOUND = 0.02  # sampling error at N = 40k is ~0.005; TV(P_DRAFT, P_TARGET) = 0.55


def run_trials(draft_probs: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    target = torch.stack([P_TARGET, P_TARGET_2, P_TARGET]).expand(N, 3, VOCAB)
    return rejection_sample(drafts, torch.full((N,), 2), draft_probs, target,
                            torch.zeros(N, dtype=torch.bool), [None] * N)


def test_first_token_follows_the_target_with_a_different_draft_distribution() -> None:
    torch.manual_seed(0)
    drafts = torch.multinomial(P_DRAFT, 2 * N, replacement=True).view(N, 2)
    out = run_trials(P_DRAFT.expand(N, 2, VOCAB), drafts)
    assert tv(out[:, 0], P_TARGET) < TV_BOUND
    # After an accepted first draft, the second token follows the target's second row.
    second = out[:, 1][out[:, 1] != P]
    assert second.numel() > N // 4
    assert tv(second, P_TARGET_2) < 2 * TV_BOUND
    # Naive "always accept the draft" is far outside the same bound.
    assert tv(drafts[:, 0], P_TARGET) > 10 * TV_BOUND


def test_first_token_follows_the_target_with_a_greedy_drafter() -> None:
    torch.manual_seed(1)
    drafts = torch.multinomial(P_DRAFT, 2 * N, replacement=True).view(N, 2)
    out = run_trials(None, drafts)
    assert tv(out[:, 0], P_TARGET) < TV_BOUND
    assert tv(drafts[:, 0], P_TARGET) > 10 * TV_BOUND
    # A one-hot drafter whose token is always 6 (target probability 0.05).
    out = run_trials(None, torch.full((N, 2), 6))
    assert tv(out[:, 0], P_TARGET) < TV_BOUND


def test_zero_draft_tokens_is_plain_sampling_from_the_target() -> None:
    torch.manual_seed(2)
    out = rejection_sample(torch.empty(N, 0, dtype=torch.int64), torch.zeros(N, dtype=torch.int64),
                           None, P_TARGET.expand(N, 1, VOCAB), torch.zeros(N, dtype=torch.bool),
                           [None] * N)
    assert out.shape == (N, 1)
    assert tv(out[:, 0], P_TARGET) < TV_BOUND


# ---- seeded determinism ----------------------------------------------------------------------

def random_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, 4, VOCAB, generator=g), -1)
    draft_probs = torch.softmax(torch.randn(batch, 3, VOCAB, generator=g), -1)
    drafts = torch.randint(0, VOCAB, (batch, 3), generator=g)
    num_draft = torch.randint(0, 4, (batch,), generator=g)
    return drafts, num_draft, draft_probs, target


def seeded_outputs(seeds: list[int], rows: list[int], steps: int = 3) -> list[torch.Tensor]:
    """Outputs of `steps` consecutive calls on the given rows of a fixed random batch."""
    drafts, num_draft, draft_probs, target = random_batch(16, seed=10)
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in seeds]
    greedy = torch.zeros(len(rows), dtype=torch.bool)
    return [rejection_sample(drafts[rows], num_draft[rows], draft_probs[rows], target[rows],
                             greedy, generators) for _ in range(steps)]


def test_same_seeds_give_the_same_tokens() -> None:
    rows = list(range(16))
    first = seeded_outputs(list(range(100, 116)), rows)
    second = seeded_outputs(list(range(100, 116)), rows)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_a_request_samples_the_same_alone_or_in_a_batch() -> None:
    batched = seeded_outputs([100 + r for r in range(16)], list(range(16)))
    for r in (0, 5, 11):
        alone = seeded_outputs([100 + r], [r])
        for step_alone, step_batched in zip(alone, batched, strict=True):
            assert torch.equal(step_alone[0], step_batched[r])
    # Unseeded neighbours (global RNG) do not disturb a seeded request either.
    drafts, num_draft, draft_probs, target = random_batch(16, seed=10)
    torch.manual_seed(123)
    mixed = rejection_sample(drafts[[3, 7]], num_draft[[3, 7]], draft_probs[[3, 7]],
                             target[[3, 7]], torch.zeros(2, dtype=torch.bool),
                             [None, torch.Generator().manual_seed(107)])
    assert torch.equal(mixed[1], batched[0][7])


def test_different_seeds_give_different_tokens() -> None:
    rows = [2] * 64  # the same request 64 times, each with its own seed
    out = seeded_outputs(list(range(64)), rows, steps=1)[0]
    assert len({tuple(row) for row in out.tolist()}) > 1


def test_generator_count_must_match_batch() -> None:
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64),
                         None, greedy_target([[1, 2], [1, 2]]), torch.ones(2, dtype=torch.bool),
                         [None])


# ---- num_accepted ----------------------------------------------------------------------------

def test_num_accepted_is_emitted_tokens_minus_one() -> None:
    out = torch.tensor([[3, 1, 4, 6], [2, 7, P, P], [5, P, P, P], [1, 2, P, P]])
    assert num_accepted(out, torch.tensor([3, 1, 0, 2])).tolist() == [3, 1, 0, 1]


def test_greedy_verify_matches_rejection_sample_on_greedy_rows() -> None:
    from runtime.speculative.rejection_sampler import greedy_verify

    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 3, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    argmax = logits.argmax(-1)
    # drafts agree with the argmax at random positions, so every acceptance length occurs
    drafts = torch.where(torch.rand(batch, k, generator=g) < 0.7, argmax[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=g))
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    probs = torch.nn.functional.one_hot(argmax, vocab).float()
    greedy = torch.ones(batch, dtype=torch.bool)
    expected = rejection_sample(drafts, num_drafts, None, probs, greedy,
                                [None] * batch)
    assert torch.equal(greedy_verify(drafts, num_drafts, argmax), expected)
    lengths = (expected != PLACEHOLDER_TOKEN_ID).sum(-1)
    assert set(lengths.tolist()) == {1, 2, 3, 4}
