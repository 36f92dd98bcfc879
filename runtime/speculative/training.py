"""Training an EAGLE drafter on cached target features (see train_data.py for the data).

EAGLE-1: loss = smooth-L1(drafter feature, target's next feature) + ce_weight * soft cross-entropy
against the target's next-token distribution (softmax of the frozen LM head over the target's
feature, restricted to the `loss_vocab` most frequent answer tokens to keep the LM head cheap).
EAGLE-3: cross-entropy of the drafter's own LM head (draft vocabulary) against the target's tokens.
Both unroll `num_steps` draft steps (train_forward.py) with weights step_decay ** j.
The target's embedding and LM head are frozen and shared; only the drafter trains.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from runtime.speculative.drafter import EagleDrafter
from runtime.speculative.train_data import PackedShard
from runtime.speculative.train_forward import unrolled_forward


@dataclass(frozen=True)
class TrainConfig:
    num_steps: int = 3  # unrolled draft steps (training-time test), usually k
    lr: float = 5e-4
    warmup_steps: int = 50
    max_steps: int | None = None
    time_budget_s: float | None = None
    batch_tokens: int = 4096  # padded tokens per batch
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    ce_weight: float = 0.1  # EAGLE-1's token loss weight
    step_decay: float = 0.8  # weight of unrolled step j is step_decay ** j
    feature_noise: float = 0.0  # uniform noise on the target's input features (EAGLE-1 recipe)
    autocast_bf16: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_budget_s is None:
            raise ValueError("give max_steps or time_budget_s")


class Batch(NamedTuple):
    token_ids: torch.Tensor  # [B, T] int64, right-padded
    features: torch.Tensor  # [B, T, F] float32
    loss_mask: torch.Tensor  # [B, T] bool: position t holds an answer token to predict


class StepMetrics(NamedTuple):
    loss: float
    accuracy: list[float]  # per unrolled step: drafted token == target token
    counts: list[int]  # predicted tokens per step


def make_batches(shard: PackedShard, batch_tokens: int, generator: torch.Generator
                 ) -> list[list[int]]:
    """Sequence indices of the shard grouped into batches of about batch_tokens padded tokens,
    similar lengths together, in a random order."""
    lengths = (shard.seq_starts[1:] - shard.seq_starts[:-1]).tolist()
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in perm]


def collate(shard: PackedShard, seqs: list[int]) -> Batch:
    starts = shard.seq_starts
    width = max(int(starts[s + 1] - starts[s]) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    feats = torch.zeros(len(seqs), width, shard.features.shape[1])
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        lo, hi = int(starts[s]), int(starts[s + 1])
        ids[b, :hi - lo] = shard.input_ids[lo:hi]
        feats[b, :hi - lo] = shard.features[lo:hi].float()
        mask[b, int(shard.loss_start[s]):hi - lo] = True
    return Batch(ids, feats, mask)


class DrafterTrainer:
    """Holds the drafter, its optimizer and the loss. `loss_vocab`: [V] target token ids the
    EAGLE-1 token loss is computed over; `t2d`: [vocab] target id -> draft id or -1 (EAGLE-3)."""

    def __init__(self, drafter: EagleDrafter, config: TrainConfig,
                 loss_vocab: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> None:
        self.drafter = drafter
        self.config = config
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.step = 0
        self.elapsed_s = 0.0
        target = drafter.target[0]
        vocab = target.config.vocab_size
        self.loss_vocab = loss_vocab if loss_vocab is not None else torch.arange(vocab)
        self.head = target.head_weight.detach()[self.loss_vocab]  # [V, H] frozen
        self.t2d = t2d

    def progress(self) -> float:
        c = self.config
        by_steps = self.step / c.max_steps if c.max_steps else 0.0
        by_time = self.elapsed_s / c.time_budget_s if c.time_budget_s else 0.0
        return min(1.0, max(by_steps, by_time))

    def learning_rate(self) -> float:
        c = self.config
        if self.step < c.warmup_steps:
            return c.lr * (self.step + 1) / c.warmup_steps
        return c.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * self.progress())))

    def train_step(self, batch: Batch) -> StepMetrics:
        started = time.perf_counter()
        self.drafter.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.autocast_bf16):
            loss, acc, counts = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.optimizer.step()
        self.step += 1
        self.elapsed_s += time.perf_counter() - started
        return StepMetrics(float(loss.detach()), acc, counts)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, list[float], list[int]]:
        c = self.config
        feats = batch.features
        if c.feature_noise and self.drafter.training:
            feats = feats + (torch.rand_like(feats) - 0.5) * 2 * c.feature_noise
        hidden = unrolled_forward(self.drafter, batch.token_ids, feats, c.num_steps)
        t = batch.token_ids.shape[1]
        total = torch.zeros(())
        accuracy, counts = [], []
        for j, h in enumerate(hidden):
            # row p of step j predicts the feature at p + j + 1 and the token at p + j + 2
            shift = j + 2
            mask = torch.zeros_like(batch.loss_mask)
            mask[:, :t - shift] = batch.loss_mask[:, shift:]
            h = h[mask]  # [n, H]
            tokens = batch.token_ids[:, shift:][mask[:, :t - shift]]  # [n]
            step_loss, correct = self._step_loss(h, batch.features[:, j + 1:][mask[:, :t - j - 1]],
                                                 tokens)
            total = total + c.step_decay**j * step_loss
            accuracy.append(correct / max(1, len(tokens)))
            counts.append(len(tokens))
        return total, accuracy, counts

    def _step_loss(self, h: torch.Tensor, target_feats: torch.Tensor, tokens: torch.Tensor
                   ) -> tuple[torch.Tensor, int]:
        """h: [n, H] drafter outputs; target_feats: [n, F] the target's next features;
        tokens: [n] the target's next tokens. Returns (loss, number of correct argmax tokens)."""
        if self.drafter.style == "eagle1":
            logits = h @ self.head.T.to(h.dtype)  # [n, V]
            with torch.no_grad():
                target_p = torch.softmax(target_feats.float() @ self.head.T.float(), dim=-1)
            ce = -(target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
            reg = F.smooth_l1_loss(h.float(), target_feats.float())
            drafted = self.loss_vocab[logits.argmax(-1)]
            return reg + self.config.ce_weight * ce, int((drafted == tokens).sum())
        assert self.t2d is not None
        logits = self.drafter.lm_head(self.drafter.norm(h)).float()  # [n, draft_vocab]
        labels = self.t2d[tokens]
        ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        ce = (ce * (labels >= 0)).mean()
        drafted = logits.argmax(-1)
        drafted = drafted + self.drafter.d2t[drafted]
        return ce, int((drafted == tokens).sum())

    def state(self) -> dict[str, Any]:
        return {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "elapsed_s": self.elapsed_s}

    def load_state(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.elapsed_s = float(state["elapsed_s"])

    def done(self) -> bool:
        c = self.config
        return ((c.max_steps is not None and self.step >= c.max_steps)
                or (c.time_budget_s is not None and self.elapsed_s >= c.time_budget_s))
