"""Exact positions, feature rows and next tokens of the first draft step (proposer docstring)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.config import SamplingParams
from runtime.inputs import prepare_inputs
from runtime.scheduler import ScheduledSeq, SchedulerOutput
from runtime.sequence import Sequence
from runtime.speculative.loader import load_drafter_checkpoint
from runtime.speculative.proposer import EagleProposer
from tests.drafter_fixtures import make_random_drafter


def make_seq(request_id: str, tokens: list[int], computed: int, drafts: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens, SamplingParams(), 0, 3)
    seq.num_computed_tokens = computed
    seq.draft_token_ids = drafts
    return seq


def test_first_draft_step_rows_after_partial_acceptance_and_a_prefill_chunk() -> None:
    # A: t0..t9 (10 tokens, 9 computed) + drafts [d0, d1, d2] = [100, 101, 102]; the target
    #    accepted 100 and 101 and emitted [100, 101, 55].
    # B: a 7-token prompt cut to its first 4 tokens (no sample).
    a = make_seq("a", list(range(10)), 9, [100, 101, 102])
    b = make_seq("b", [20, 21, 22, 23, 24, 25, 26], 0, [])
    out = SchedulerOutput((ScheduledSeq(a, 9, 4), ScheduledSeq(b, 0, 4)), 8, ())
    step = prepare_inputs(out, [[1, 2, 3, 4], [5, 6]], 4, torch.device("cpu"))
    proposer = EagleProposer.__new__(EagleProposer)
    rows = proposer._first_step_rows(step, out, [[100, 101, 55], None], [3, 0])
    # A: verified positions 9, 10, 11 (t9, d0, d1); the tokens after them: d0, d1, 55
    # B: positions 0..3, the tokens after them are prompt tokens 21..24
    assert rows.positions == [9, 10, 11, 0, 1, 2, 3]
    assert rows.input_ids == [100, 101, 55, 21, 22, 23, 24]
    assert rows.feature_rows == [0, 1, 2, 4, 5, 6, 7]  # A's rejected d2 (row 3) is skipped
    assert rows.query_lens == [3, 4]
    assert rows.last_rows == [2] and rows.sampling == [0]


def test_single_layer_eagle3_checkpoint_with_midlayer_names_loads(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = make_random_drafter(tiny_model_dir, tmp_path / "e3", num_layers=1, style="eagle3",
                               draft_vocab_size=64, aux_layer_ids=(0, 1, 1))
    tensors = load_file(str(ckpt / "model.safetensors"))
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    assert "midlayer.hidden_norm.weight" in renamed and "d2t" in renamed
    save_file(renamed, str(ckpt / "model.safetensors"))
    from transformers import AutoConfig
    loaded = load_drafter_checkpoint(ckpt, AutoConfig.from_pretrained(tiny_model_dir))
    assert loaded.style == "eagle3"
    assert loaded.aux_layer_ids == (0, 1, 1)
    assert torch.equal(loaded.state_dict["hidden_norm.weight"],
                       tensors["layers.0.hidden_norm.weight"])
    assert torch.equal(loaded.state_dict["embed_norm.weight"],
                       tensors["layers.0.input_layernorm.weight"])
    assert loaded.state_dict["lm_head.weight"].shape == (64, 64)
