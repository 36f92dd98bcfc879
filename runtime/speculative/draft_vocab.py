"""A drafter checkpoint's vocabularies against the target's: the checks that refuse a drafter
made for another model, and d2t (draft id -> target id) derived from t2d where a checkpoint
has only that."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig


class DrafterMismatchError(ValueError):
    """The drafter cannot run on this target; the message names the differing field."""


def check_vocab(raw: dict, tensors: dict[str, torch.Tensor], style: str,
                 target: PretrainedConfig, path: Path) -> None:
    """A drafter made for another vocabulary is refused, naming where it says so: its
    config.json's vocab_size (the target's, in every public layout; a drafter with its own head
    names the draft vocabulary in draft_vocab_size), an embedding copied from another model, or
    a draft_vocab_size that its head contradicts. (A t2d beside a d2t is not read: vLLM reads
    d2t alone, and some checkpoints keep t2d as an unfilled buffer.)"""
    where = path / "config.json"
    vocab = raw.get("vocab_size")
    if isinstance(vocab, int) and vocab != target.vocab_size:
        raise DrafterMismatchError(f"drafter {where}: vocab_size is {vocab} but the target's is "
                                   f"{target.vocab_size}: a drafter made for another model")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and embed.shape[0] != target.vocab_size:
        raise DrafterMismatchError(f"drafter {path}: embed_tokens.weight has {embed.shape[0]} rows "
                                   f"but the target's vocabulary has {target.vocab_size}: a "
                                   "drafter made for another model")
    head = tensors.get("lm_head.weight")
    if head is not None and head.dim() != 2:
        raise DrafterMismatchError(f"drafter {path}: lm_head.weight has shape "
                                   f"{tuple(head.shape)}; expected [draft vocabulary, hidden "
                                   "size]")
    declared = raw.get("draft_vocab_size")
    if head is not None and isinstance(declared, int) and declared != head.shape[0]:
        raise DrafterMismatchError(f"drafter {where}: draft_vocab_size is {declared} but "
                                   f"lm_head.weight has {head.shape[0]} rows")


def d2t_from_t2d(tensors: dict[str, torch.Tensor], target_vocab: int, path: Path
                  ) -> torch.Tensor:
    """d2t (target id = draft id + d2t[draft id]) from t2d, the mask of target ids in the draft
    vocabulary: the i-th marked target id is draft token i."""
    t2d = tensors["t2d"]
    if t2d.dim() != 1 or len(t2d) != target_vocab:
        raise DrafterMismatchError(f"drafter {path}: t2d has shape {tuple(t2d.shape)}; expected "
                                   f"[{target_vocab}] (one flag per target token) to derive d2t, "
                                   "which the checkpoint lacks")
    if _is_id_map(t2d):  # each draft id once
        draft_ids = t2d[t2d >= 0].sort().values
        if not torch.equal(draft_ids, torch.arange(len(draft_ids), dtype=draft_ids.dtype)):
            raise DrafterMismatchError(
                f"drafter {path}: t2d maps {len(draft_ids)} target tokens to draft ids "
                f"{int(draft_ids[0])}..{int(draft_ids[-1])}, not to each of "
                f"0..{len(draft_ids) - 1} once; d2t, which the checkpoint lacks, cannot be "
                "derived")
    target_ids = _draft_tokens_of_t2d(t2d)
    head = tensors.get("lm_head.weight")
    if head is not None and len(target_ids) != head.shape[0]:
        raise DrafterMismatchError(f"drafter {path}: t2d marks {len(target_ids)} target tokens "
                                   f"but lm_head.weight has {head.shape[0]} rows (one per draft "
                                   "token); d2t, which the checkpoint lacks, cannot be derived")
    return target_ids - torch.arange(len(target_ids))


def _is_id_map(t2d: torch.Tensor) -> bool:
    """Whether t2d maps each target id to its draft id (-1 elsewhere), not marks them."""
    return t2d.dtype != torch.bool and bool((t2d < 0).any())


def _draft_tokens_of_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft tokens, in draft-token order, from t2d: a mask over the
    target's vocabulary (EAGLE's: the i-th marked id is draft token i), or a map of each target
    id to its draft id and -1 elsewhere."""
    if _is_id_map(t2d):
        ids = (t2d >= 0).nonzero().flatten()
        return ids[t2d[ids].argsort()]
    return t2d.bool().nonzero().flatten()
