"""Acceptance counters for speculative decoding, per request or summed over a shard."""

from __future__ import annotations


class SpecDecodingStats:
    """Mutable counters; observe() once per verification step of one request.

    num_draft_steps: verification steps that had at least one draft token.
    num_drafted / num_accepted: draft tokens proposed / accepted over those steps.
    accepted_per_position[j]: steps whose draft token at position j was accepted.
    """

    __slots__ = ("num_draft_steps", "num_drafted", "num_accepted", "accepted_per_position")

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.num_draft_steps = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Count one verification step: num_draft proposed, the first num_accepted accepted.
        A step with no draft token (plain decoding) counts nothing."""
        if not 0 <= num_accepted <= num_draft <= len(self.accepted_per_position):
            raise ValueError(f"need 0 <= num_accepted ({num_accepted}) <= num_draft "
                             f"({num_draft}) <= k ({len(self.accepted_per_position)})")
        if num_draft == 0:
            return
        self.num_draft_steps += 1
        self.num_drafted += num_draft
        self.num_accepted += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        """Add other's counts into self (mutates self; k grows to the larger of the two)."""
        self.num_draft_steps += other.num_draft_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        missing = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(missing, 0))
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted; None when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per draft step, 1 + accepted / draft steps (vLLM's definition)."""
        if not self.num_draft_steps:
            return None
        return 1.0 + self.num_accepted / self.num_draft_steps

    @property
    def per_position_rates(self) -> list[float] | None:
        """Accepted at position j / draft steps; None when there was no draft step."""
        if not self.num_draft_steps:
            return None
        return [count / self.num_draft_steps for count in self.accepted_per_position]

    def summary_line(self) -> str:
        """'acceptance rate 61.2% | mean acceptance length 2.84 | per position 0.81 0.64 0.39'."""
        rate, length, per_position = (
            self.acceptance_rate, self.mean_acceptance_length, self.per_position_rates)
        if rate is None or length is None or per_position is None:
            return "no draft tokens"
        positions = " ".join(f"{r:.2f}" for r in per_position)
        return (f"acceptance rate {rate:.1%} | mean acceptance length {length:.2f} | "
                f"per position {positions}")

    def to_dict(self) -> dict[str, object]:
        return {
            "num_draft_steps": self.num_draft_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_rates": self.per_position_rates,
        }

    def __repr__(self) -> str:
        return (f"SpecDecodingStats(num_draft_steps={self.num_draft_steps}, "
                f"num_drafted={self.num_drafted}, num_accepted={self.num_accepted}, "
                f"accepted_per_position={self.accepted_per_position})")
