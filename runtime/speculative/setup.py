"""Building the EAGLE proposer for an engine: load, check the fit, name the draft layers."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.config import EngineConfig
from runtime.cpu_gemm import PrepackedLinear, lay_out_for_cpu
from runtime.host_memory import return_freed_memory
from runtime.kv.groups import draft_layer_name
from runtime.kv.spec import AttentionSpec
from runtime.model import CausalLM, head_dim_of, layer_windows
from runtime.rope import RotaryEmbedding
from runtime.setup import Placement, attention_specs
from runtime.speculative.drafter import EagleDrafter
from runtime.speculative.loader import load_drafter_checkpoint
from runtime.speculative.proposer import EagleProposer


def build_proposer(config: EngineConfig, target: CausalLM, p: Placement, max_positions: int
                   ) -> tuple[EagleProposer, dict[str, AttentionSpec]]:
    """Returns the proposer and the draft layers' KV specs, named after the target's layers
    (layers.{L + i}) so they can never collide with them."""
    assert config.drafter is not None
    ckpt = load_drafter_checkpoint(Path(config.drafter), target.config)
    n_target = target.config.num_hidden_layers
    names = [draft_layer_name(n_target, i) for i in range(ckpt.config.num_hidden_layers)]
    windows = layer_windows(ckpt.config, max_positions, any_architecture=True)
    drafter = EagleDrafter(ckpt.config, ckpt.style, target, names, p.backend,
                           fc_bias="fc.bias" in ckpt.state_dict, windows=windows,
                           own_head="lm_head.weight" in ckpt.state_dict)
    if drafter.own_head and "norm.weight" not in ckpt.state_dict:
        drafter.norm = torch.nn.Identity()  # type: ignore[assignment]  # a head applied straight to the output (vLLM layout)
    load_drafter_weights(drafter, ckpt.state_dict, config.drafter)
    drafter.rope = RotaryEmbedding(ckpt.config, head_dim_of(ckpt.config), max_positions)
    drafter = drafter.to(device=p.device, dtype=p.dtype).eval()
    if p.device.type == "cpu":
        lay_out_for_cpu(drafter, int8=config.draft_int8, release_weights=True)  # own head too
        # its own head, if any, lets go of its weight too: only a target head's weight is
        # read after packing (for the exact greedy head's copies, runtime.setup)
        head = getattr(drafter, "lm_head", None)
        if isinstance(head, PrepackedLinear):
            head.release_weight()
            return_freed_memory()
    specs = attention_specs(ckpt.config, names, p.block_size, p.dtype, windows)
    proposer = EagleProposer(drafter, config.num_speculative_tokens, ckpt.aux_layer_ids, p.device,
                             config.draft_confidence, config.draft_max_batch, config.draft_ngram,
                             config.draft_width)
    return proposer, specs


def load_drafter_weights(drafter: EagleDrafter, state: dict[str, torch.Tensor], where: str
                         ) -> None:
    params = {k: v for k, v in drafter.state_dict().items()}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"drafter {where}: weights do not match an EAGLE {drafter.style} drafter "
                         f"with {len(drafter.layers)} layers: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
             for k, v in params.items() if state[k].shape != v.shape]
    if wrong:
        c = drafter.config
        raise ValueError(f"drafter {where}: weights do not have the shapes its config.json gives "
                         f"(hidden_size {c.hidden_size}, num_attention_heads "
                         f"{c.num_attention_heads}, num_key_value_heads {c.num_key_value_heads}, "
                         f"head_dim {head_dim_of(c)}, intermediate_size {c.intermediate_size}): "
                         + "; ".join(wrong[:4]))
    drafter.load_state_dict(state, strict=True)
