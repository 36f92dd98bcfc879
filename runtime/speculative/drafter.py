"""EAGLE drafter models: N >= 1 Llama decoder layers on top of the target's features.

EAGLE-1: x = fc(concat(embed(next token), feature)) with feature = the target's final hidden state
(2H -> H); N decoder layers (layer 0 without its input norm); the target's LM head gives logits
(or, when the checkpoint has norm + lm_head [+ d2t], its own head as in EAGLE-3).
EAGLE-3: feature = concat of the residual streams entering three target layers, fc maps 3H -> H;
layer 0 attends over concat(input_norm(embed), hidden_norm(fc out)) (2H inputs to q/k/v) with the
fc output as residual (with norm_before_residual: hidden_norm(fc out)); later layers are ordinary;
its own norm and LM head over a draft vocabulary, mapped to target ids by
target_id = draft_id + d2t[draft_id].

The embedding (and, for EAGLE-1, the LM head) belong to the target and are shared, not copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from runtime.attention import AttentionMetadata
from runtime.cpu_layer import CpuLayerStack
from runtime.model import CausalLM, DecoderLayer, RMSNorm
from runtime.rope import RotaryEmbedding


class EagleDrafter(nn.Module):
    def __init__(self, config: PretrainedConfig, style: str, target: CausalLM,
                 layer_names: list[str], backend_name: str, fc_bias: bool,
                 windows: list[int | None], own_head: bool | None = None) -> None:
        super().__init__()
        if style not in ("eagle1", "eagle3"):
            raise ValueError(f"drafter style must be eagle1 or eagle3, got {style!r}")
        h = config.hidden_size
        self.style = style
        self.config = config
        self.target = [target]  # a list, so the target's parameters are not registered twice
        feature_size = 3 * h if style == "eagle3" else 2 * h
        self.fc = nn.Linear(feature_size, h, bias=fc_bias)
        self.layers = nn.ModuleList()
        for i, name in enumerate(layer_names):
            first = i == 0
            self.layers.append(DecoderLayer(
                config, name, backend_name, windows[i],
                input_size=2 * h if (first and style == "eagle3") else None,
                input_norm=not first))
        if style == "eagle3":
            self.embed_norm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        # EAGLE-3 variant (speculators' checkpoints): layer 0's residual is hidden_norm(fc out)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        # EAGLE-3 always has its own norm + LM head over a draft vocabulary; an EAGLE-1 drafter
        # may have one too (a smaller head makes each draft step cheaper).
        self.own_head = style == "eagle3" if own_head is None else own_head
        if self.own_head:
            self.norm = RMSNorm(h, config.rms_norm_eps)
            draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head: nn.Module = nn.Linear(h, draft_vocab, bias=False)
            self.d2t: torch.Tensor  # [draft_vocab] int64: target_id = draft_id + d2t[draft_id]
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.rope: RotaryEmbedding | None = None
        self.cpu_stack: CpuLayerStack | None = None  # set by stack_for_cpu

    def stack_for_cpu(self) -> None:
        """The planned layers as one C++ call (runtime.cpu_layer.CpuLayerStack;
        lay_out_for_cpu calls this after the plans)."""
        self.cpu_stack = CpuLayerStack.build(list(self.layers))  # type: ignore[arg-type]

    @property
    def layer_names(self) -> list[str]:
        return [layer.self_attn.layer_name for layer in self.layers]  # type: ignore[union-attr,misc]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] the token after each feature's position
        positions: torch.Tensor,  # [num_tokens]
        features: torch.Tensor,  # [num_tokens, 3H or 2H... see below]
        kv_caches: Mapping[str, torch.Tensor],
        attn_metadata: Mapping[str, AttentionMetadata],
    ) -> torch.Tensor:  # [num_tokens, hidden_size], fed back as the next step's feature
        """features: the target's features (EAGLE-1: [n, H]; EAGLE-3: [n, 3H]) in the first draft
        step, the drafter's own previous output ([n, H]) in later ones."""
        assert self.rope is not None, "bind the rope table before running the drafter"
        x, residual = self.layer_inputs(input_ids, features)
        if self.cpu_stack is not None:
            out = self.cpu_stack.run(x, residual, positions, self.rope, kv_caches, attn_metadata)
            if out is not None:
                return out[0]
        for layer in self.layers:
            residual = layer(x, residual, positions, self.rope, kv_caches, attn_metadata)
            x = residual
        return residual

    def layer_inputs(self, input_ids: torch.Tensor, features: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(first layer's input, residual) from the next tokens and the features; any leading
        shape ([n] or [batch, time]). EAGLE-1: fc(concat(embed, feature)) for both. EAGLE-3:
        residual = fc(target features) (the drafter's own H-wide output passes as is), input =
        concat(norm(embed), norm(residual)); with norm_before_residual the residual is
        norm(residual) too."""
        embeds = self.target[0].model.embed_tokens(input_ids)
        if self.style == "eagle1":
            x = self.fc(torch.cat((embeds, features), dim=-1))
            return x, x
        residual = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        normed = self.hidden_norm(residual)
        if self.norm_before_residual:
            residual = normed
        return torch.cat((self.embed_norm(embeds), normed), dim=-1), residual

    def compute_draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n] greedy draft token ids in the target's vocabulary."""
        return self.draft_with_confidence(hidden, confidence=False)[0]

    def draft_with_confidence(self, hidden: torch.Tensor, confidence: bool = True
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, H] -> ([n] greedy draft token ids in the target's vocabulary, [n] the drafter's
        probability of each, or None when confidence is False)."""
        if self.own_head:
            logits = self.lm_head(self.norm(hidden))
        else:
            logits = self.target[0].compute_logits(hidden)
        peak, draft_ids = logits.max(-1)
        prob = None
        if confidence:  # softmax at the argmax: 1 / sum(exp(logits - max))
            prob = (logits - peak.unsqueeze(-1)).exp_().sum(-1).reciprocal_()
        if self.own_head:
            draft_ids = draft_ids + self.d2t[draft_ids]
        return draft_ids, prob

