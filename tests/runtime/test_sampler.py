from __future__ import annotations

import math

import pytest
import torch

from runtime.sampler import make_sampling_tensors, position_uniforms, target_probs


def log_probs(*probs: float) -> torch.Tensor:  # [1, vocab]
    return torch.tensor([probs]).log()


def test_make_sampling_tensors_types_and_greedy_flag() -> None:
    st = make_sampling_tensors([0.0, 0.7], [0, 5], [1.0, 0.9], "cpu")
    assert st.temperature.dtype == torch.float32
    assert st.top_k.dtype == torch.int64 and st.top_k.tolist() == [0, 5]
    assert st.top_p.dtype == torch.float32
    assert st.greedy.tolist() == [True, False]
    assert st.filtered
    assert not make_sampling_tensors([1.0], [0], [1.0], "cpu").filtered


def test_make_sampling_tensors_rejects_ragged_lists() -> None:
    with pytest.raises(ValueError, match="one of each per request"):
        make_sampling_tensors([1.0, 1.0], [0], [1.0, 1.0], "cpu")


def test_temperature_scaling_is_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    st = make_sampling_tensors([2.0], [0], [1.0], "cpu")
    probs = target_probs(logits, st, positions_per_row=1)
    assert probs.shape == (1, 1, 4) and probs.dtype == torch.float32
    expected = torch.tensor([math.exp(x / 2.0) for x in (1.0, 2.0, 3.0, 0.0)])
    torch.testing.assert_close(probs[0, 0], expected / expected.sum())


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    st = make_sampling_tensors([1.0], [5], [1.0], "cpu")
    probs = target_probs(logits, st, 1)[0, 0]
    kept = probs.nonzero().squeeze(-1)
    assert sorted(kept.tolist()) == sorted(logits[0].topk(5).indices.tolist())
    torch.testing.assert_close(probs[kept], torch.softmax(logits[0, kept], -1))


def test_top_k_keeps_exactly_k_under_ties() -> None:
    st = make_sampling_tensors([1.0], [3], [1.0], "cpu")
    probs = target_probs(torch.zeros(1, 8), st, 1)[0, 0]
    assert probs.tolist() == pytest.approx([1 / 3] * 3 + [0.0] * 5)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.4
        (0.7, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.7 <= 0.8
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.85 <= 0.95
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_the_minimal_set(top_p: float, expected: list[float]) -> None:
    st = make_sampling_tensors([1.0], [0], [top_p], "cpu")
    probs = target_probs(log_probs(0.05, 0.3, 0.5, 0.15), st, 1)[0, 0]
    # vocab order is [0.05, 0.3, 0.5, 0.15]; expected is listed in sorted order
    assert probs[[2, 1, 3, 0]].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_k_is_applied_before_top_p() -> None:
    # top-k 3 -> [4/9, 3/9, 2/9]; top_p 0.7: mass before = [0, 0.44, 0.78] -> keep two.
    st = make_sampling_tensors([1.0], [3], [0.7], "cpu")
    probs = target_probs(log_probs(0.4, 0.3, 0.2, 0.1), st, 1)[0, 0]
    assert probs.tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0], abs=1e-6)


def test_top_p_one_keeps_tiny_tokens() -> None:
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0]])  # tail mass ~1e-13, lost in the cumsum
    st = make_sampling_tensors([1.0], [0], [1.0], "cpu")
    assert (target_probs(logits, st._replace(filtered=True), 1) > 0).all()


def test_greedy_rows_are_one_hot_at_the_raw_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [0.1, 3.0, 2.9, -1.0]])
    st = make_sampling_tensors([0.0, 1.0], [2, 0], [0.5, 1.0], "cpu")
    probs = target_probs(logits, st, 1)
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 0].sum().item() == pytest.approx(1.0)
    assert (probs[1, 0] > 0).all()


def test_rows_are_grouped_per_request() -> None:
    # batch 2, 3 positions each: rows 0-2 belong to request 0 (greedy), rows 3-5 to request 1.
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    st = make_sampling_tensors([0.0, 0.5], [0, 0], [1.0, 1.0], "cpu")
    probs = target_probs(logits, st, positions_per_row=3)
    assert probs.shape == (2, 3, 16)
    assert probs[0].argmax(-1).tolist() == logits[:3].argmax(-1).tolist()
    assert (probs[0].max(-1).values == 1.0).all()
    torch.testing.assert_close(probs[1], torch.softmax(logits[3:] / 0.5, -1))


def test_target_probs_rejects_bad_row_count() -> None:
    st = make_sampling_tensors([1.0, 1.0], [0, 0], [1.0, 1.0], "cpu")
    with pytest.raises(ValueError, match="multiple of positions_per_row"):
        target_probs(torch.zeros(5, 4), st, positions_per_row=2)


def test_position_uniforms_are_keyed_by_seed_and_token_index() -> None:
    u = position_uniforms([7, 7, 8, None], [10, 12, 10, 10], 4, "cpu")
    assert u.shape == (4, 4) and u.dtype == torch.float64
    assert ((u >= 0) & (u < 1)).all()
    assert torch.equal(u[0, 2:], u[1, :2])  # the same seed and token index, the same uniform
    assert len(set(u[0].tolist()) | set(u[2].tolist())) == 8  # other seed, other indices
    again = position_uniforms([None, 7], [0, 11], 2, "cpu")
    assert torch.equal(again[1], u[0, 1:3])  # whatever else is in the batch
    # roughly uniform over many indices and seeds
    many = position_uniforms(list(range(200)), [0] * 200, 50, "cpu").flatten()
    assert abs(many.mean().item() - 0.5) < 0.01
    assert abs((many < 0.1).double().mean().item() - 0.1) < 0.01


def test_a_seed_is_a_64_bit_pattern() -> None:
    """As the README says: a seed is taken modulo 2^64 (a uint64 column's 2^64 - 1 is an int64
    column's -1), and seeds apart by less than that draw apart."""
    u = position_uniforms([-1, 2**64 - 1, 2**64 + 5, 5, 6], [0] * 5, 3, "cpu")
    assert torch.equal(u[0], u[1]) and torch.equal(u[2], u[3])
    assert not torch.equal(u[3], u[4]) and not torch.equal(u[0], u[3])


def test_top_k_top_p_among_candidates_keep_what_sorting_the_vocabulary_keeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose filtered distribution lies within the CANDIDATES most likely tokens are sorted
    among those only; the others (a flat row under top-p, a top_k past the candidates, ties at
    the last candidate) sort the whole vocabulary. Either way a row keeps exactly the tokens a
    sort of the whole vocabulary keeps, with the same probabilities up to rounding, and its
    result does not depend on the other rows."""
    from runtime import sampler  # noqa: PLC0415
    from runtime.sampler import CANDIDATES, _sorted_vocab_probs, _top_k_top_p_probs  # noqa: PLC0415

    sorted_rows: list[int] = []  # rows that went the slow way, per call

    def counted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(len(scaled))
        return _sorted_vocab_probs(scaled, top_k, top_p)

    monkeypatch.setattr(sampler, "_sorted_vocab_probs", counted)

    g = torch.Generator().manual_seed(0)
    most = max(CANDIDATES)
    vocab = 3 * most
    top_k = torch.tensor([[0], [5], [1], [2 * most], [0], [0], [most], [3], [0]])
    top_p = torch.tensor([[0.9], [1.0], [0.5], [0.95], [1.0], [0.3], [0.99], [0.7], [0.999]])
    for trial in range(40):
        scaled = torch.randn(len(top_k), vocab, generator=g) * (1 + trial % 8)
        if trial % 4 == 0:
            scaled = scaled.round()  # ties, at the last candidate too
        fast = _top_k_top_p_probs(scaled, top_k, top_p)
        full = _sorted_vocab_probs(scaled, top_k, top_p)
        if trial % 8 == 7 and trial % 4:  # peaked and untied: only top_k 2 * most sorts all
            assert sorted_rows[-1] == 1
        # the cumulative mass is summed in another order: a token whose mass before it is
        # top_p up to rounding may be kept by one and not the other (row 8's top_p 0.999; with
        # a logsumexp for the normalizer, trial 11 kept 797 tokens against 796)
        differ = ((fast > 0) != (full > 0)).sum(-1)
        assert differ[:-1].sum() == 0 and differ[-1] <= 1
        torch.testing.assert_close(fast, full, rtol=0, atol=1e-5)
        assert (fast > 0).sum(-1)[1:3].tolist() == [5, 1]  # top_k 5; top_k 1
        for row in (0, 3, 8):
            alone = _top_k_top_p_probs(scaled[row:row + 1], top_k[row:row + 1], top_p[row:row + 1])
            assert torch.equal(alone[0], fast[row])


def test_greedy_rows_are_those_that_sampling_params_calls_greedy() -> None:
    """A float32 column's 1e-5 is 9.99999974738e-06: greedy for SamplingParams (float64), and
    was not for the tensors (compared in float32), so the row was decoded either way depending
    on the step."""
    import numpy as np  # noqa: PLC0415

    from runtime.config import SamplingParams  # noqa: PLC0415

    temperatures = [float(np.float32(1e-5)), 1e-5, 0.0, 0.7]
    assert [SamplingParams(temperature=t).greedy for t in temperatures] == [
        True, False, True, False]
    st = make_sampling_tensors(temperatures, [0] * 4, [1.0] * 4, "cpu")
    assert st.greedy.tolist() == [True, False, True, False]


def test_a_rows_top_p_does_not_depend_on_the_batch_on_two_threads() -> None:
    """Found by review: the first version normalized the candidates by a logsumexp over the
    whole vocabulary, which two threads split for a row alone and not in a batch: at a top_p
    on the edge a row kept 2 tokens in a batch of 8 and 1 alone. (The search for such a top_p
    uses that logsumexp's two sums.)"""
    from runtime.sampler import CANDIDATES, _top_k_top_p_probs  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        found = 0
        for _ in range(200):
            s = torch.randn(8, 49152, generator=g) * 3
            batched_lse, alone_lse = s.logsumexp(-1, keepdim=True)[:1], s[:1].logsumexp(-1, True)
            if torch.equal(batched_lse, alone_lse):
                continue
            v = s[:1].topk(max(CANDIDATES)).values
            before = [((v - lse).exp().cumsum(-1) - (v - lse).exp())[0]
                      for lse in (batched_lse, alone_lse)]
            edges = [max(a, b) for a, b in zip(before[0].tolist(), before[1].tolist(),
                                               strict=True) if a != b][:3]
            for top_p in edges:
                p = torch.full((8, 1), top_p)
                k = torch.zeros(8, 1, dtype=torch.int64)
                assert torch.equal(_top_k_top_p_probs(s, k, p)[0],
                                   _top_k_top_p_probs(s[:1], k[:1], p[:1])[0])
                found += 1
            if found >= 6:
                break
        assert found >= 6
    finally:
        torch.set_num_threads(threads)
