"""sample_and_verify: drafts accepted while they equal the target's own draw at their position."""

from __future__ import annotations

import pytest
import torch

from runtime.speculative.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    draw_tokens,
    greedy_verify,
    num_accepted,
    sample_and_verify,
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
    uniforms: torch.Tensor | None = None,
) -> list[list[int]]:
    batch, positions = target.shape[:2]
    out = sample_and_verify(
        torch.tensor(drafts, dtype=torch.int64).view(len(drafts), -1),
        torch.tensor(num_draft),
        target,
        torch.tensor(greedy),
        uniforms if uniforms is not None else torch.rand(batch, positions, dtype=torch.float64),
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
    out = sample_and_verify(torch.empty(2, 0, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.int64), target, torch.tensor([True, True]),
                            torch.rand(2, 1, dtype=torch.float64))
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


def test_greedy_row_ignores_its_uniforms() -> None:
    target = torch.softmax(torch.tensor([[[0.0, 1, 3, 2, 0, 0, 0, 0]] * 3]), -1)  # argmax 2
    for u in (0.0, 0.5, 0.999):
        uniforms = torch.full((1, 3), u, dtype=torch.float64)
        assert sample([[2, 5]], [2], target, [True], uniforms) == [[2, 2, P]]


# ---- random rows: the inverse distribution function ------------------------------------------

def test_draws_invert_the_distribution_function_and_skip_tokens_without_mass() -> None:
    probs = torch.tensor([0.25, 0.0, 0.25, 0.5, 0.0])  # cumulative 0.25, 0.25, 0.5, 1.0, 1.0
    u = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.75, 1.0 - 2 ** -53],
                     dtype=torch.float64)
    drawn = draw_tokens(probs.expand(len(u), 1, 5), torch.zeros(len(u), dtype=torch.bool),
                        u.unsqueeze(-1))
    assert drawn[:, 0].tolist() == [0, 0, 2, 2, 3, 3, 3]  # never 1 or 4 (no mass)
    # unnormalised rows (top-k/top-p leave them so) scale with their mass
    drawn = draw_tokens((probs * 4).expand(len(u), 1, 5), torch.zeros(len(u), dtype=torch.bool),
                        u.unsqueeze(-1))
    assert drawn[:, 0].tolist() == [0, 0, 2, 2, 3, 3, 3]


def test_random_rows_accept_a_draft_where_it_is_the_draw_and_emit_the_draw_elsewhere() -> None:
    target = torch.stack([P_TARGET, P_TARGET_2, P_TARGET]).unsqueeze(0)  # [1, 3, VOCAB]
    uniforms = torch.tensor([[0.35, 0.2, 0.99]], dtype=torch.float64)  # draws 1, 2, 7
    assert sample([[1, 2]], [2], target, [False], uniforms) == [[1, 2, 7]]
    assert sample([[1, 3]], [2], target, [False], uniforms) == [[1, 2, P]]
    assert sample([[0, 2]], [2], target, [False], uniforms) == [[1, P, P]]
    assert sample([[1, 2]], [0], target, [False], uniforms) == [[1, P, P]]


def test_the_emitted_tokens_do_not_depend_on_the_drafts() -> None:
    g = torch.Generator().manual_seed(4)
    batch, k = 500, 3
    target = torch.softmax(torch.randn(batch, k + 1, VOCAB, generator=g), -1)
    uniforms = torch.rand(batch, k + 1, generator=g, dtype=torch.float64)
    draws = draw_tokens(target, torch.zeros(batch, dtype=torch.bool), uniforms)
    for drafts, count in [(torch.randint(0, VOCAB, (batch, k), generator=g), k),
                          (draws[:, :k], k), (draws[:, :k], 1), (torch.zeros(batch, 0), 0)]:
        out = sample_and_verify(drafts.long(), torch.full((batch,), count), target[:, :k + 1]
                                if count else target[:, :1], torch.zeros(batch, dtype=torch.bool),
                                uniforms if count else uniforms[:, :1])
        emitted = out != P
        assert torch.equal(out[emitted], draws[:, :out.shape[1]][emitted])
    # perfect drafts: every draft and the draw after them
    out = sample_and_verify(draws[:, :k], torch.full((batch,), k), target,
                            torch.zeros(batch, dtype=torch.bool), uniforms)
    assert torch.equal(out, draws)


# ---- statistical: the emitted tokens follow the target --------------------------------------

N = 40_000
TV_BOUND = 0.02  # sampling error at N = 40k is ~0.005; TV(P_DRAFT, P_TARGET) = 0.55


def run_trials(drafts: torch.Tensor) -> torch.Tensor:
    target = torch.stack([P_TARGET, P_TARGET_2, P_TARGET]).expand(N, 3, VOCAB)
    return sample_and_verify(drafts, torch.full((N,), 2), target,
                             torch.zeros(N, dtype=torch.bool),
                             torch.rand(N, 3, dtype=torch.float64))


def test_first_tokens_follow_the_target_whatever_the_drafts() -> None:
    torch.manual_seed(1)
    drafts = torch.multinomial(P_DRAFT, 2 * N, replacement=True).view(N, 2)
    out = run_trials(drafts)
    assert tv(out[:, 0], P_TARGET) < TV_BOUND
    assert tv(drafts[:, 0], P_TARGET) > 10 * TV_BOUND  # "always accept" would be far off
    # after an accepted first draft, the second token follows the target's second row
    second = out[:, 1][out[:, 1] != P]
    assert second.numel() > N // 20
    assert tv(second, P_TARGET_2) < 2 * TV_BOUND
    # a drafter whose token is always 6 is accepted with the target's probability of 6
    out = run_trials(torch.full((N, 2), 6))
    assert tv(out[:, 0], P_TARGET) < TV_BOUND
    accepted = (out[:, 1] != P).float().mean().item()
    assert abs(accepted - P_TARGET[6].item()) < 0.005


def test_zero_draft_tokens_is_plain_sampling_from_the_target() -> None:
    torch.manual_seed(2)
    out = sample_and_verify(torch.empty(N, 0, dtype=torch.int64),
                            torch.zeros(N, dtype=torch.int64), P_TARGET.expand(N, 1, VOCAB),
                            torch.zeros(N, dtype=torch.bool), torch.rand(N, 1, dtype=torch.float64))
    assert out.shape == (N, 1)
    assert tv(out[:, 0], P_TARGET) < TV_BOUND


def test_uniforms_must_cover_every_position() -> None:
    with pytest.raises(ValueError, match=r"uniforms of shape \(2, 1\) for a batch of 2 with 1 "
                                         r"draft positions; need \[2, 2\]"):
        sample_and_verify(torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64),
                          greedy_target([[1, 2], [1, 2]]), torch.ones(2, dtype=torch.bool),
                          torch.zeros(2, 1, dtype=torch.float64))


# ---- num_accepted ----------------------------------------------------------------------------

def test_num_accepted_is_emitted_tokens_minus_one() -> None:
    out = torch.tensor([[3, 1, 4, 6], [2, 7, P, P], [5, P, P, P], [1, 2, P, P]])
    assert num_accepted(out, torch.tensor([3, 1, 0, 2])).tolist() == [3, 1, 0, 1]


def test_greedy_verify_matches_sample_and_verify_on_greedy_rows() -> None:
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 3, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    argmax = logits.argmax(-1)
    # drafts agree with the argmax at random positions, so every acceptance length occurs
    drafts = torch.where(torch.rand(batch, k, generator=g) < 0.7, argmax[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=g))
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    probs = torch.softmax(logits, -1)
    greedy = torch.ones(batch, dtype=torch.bool)
    expected = sample_and_verify(drafts, num_drafts, probs, greedy,
                                 torch.rand(batch, k + 1, dtype=torch.float64))
    assert torch.equal(greedy_verify(drafts, num_drafts, argmax), expected)
