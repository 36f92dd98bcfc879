"""Grouping layers into KV cache groups, sizing the cache, and the draft-layer group check.

A KV cache group is a set of layers with equal AttentionSpecs; they share one block table, so a
request's block ids index the same pages in every layer of the group. Every layer (target and
draft alike) gets num_blocks pages of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from runtime.kv.spec import AttentionSpec

# Block 0 is the reserved null/padding block, so a usable cache needs at least one more.
MIN_NUM_BLOCKS = 2


class KVCacheGroupError(ValueError):
    """Draft layers that do not all live in one KV cache group (or are missing from it)."""


class KVCacheBudgetError(ValueError):
    """The KV cache memory budget holds too few blocks, or cannot be allocated."""


def target_layer_name(index: int) -> str:
    """Cache name of the target model's layer `index`: target_layer_name(3) == "layers.3"."""
    return f"layers.{index}"


def draft_layer_name(target_num_layers: int, draft_index: int) -> str:
    """Cache name of draft layer `draft_index`, offset past the target's layers so names never
    collide: with a 30-layer target, draft_layer_name(30, 0) == "layers.30", (30, 1) -> "layers.31".
    """
    return f"layers.{target_num_layers + draft_index}"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table because their specs are equal."""

    spec: AttentionSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks every layer gets, and which layers share a block table."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    draft_layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = self.layer_names
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"layer names appear in more than one place: {', '.join(dupes)}")

    @property
    def layer_names(self) -> tuple[str, ...]:
        """All layer names, group by group, each group in its own order."""
        return tuple(name for group in self.groups for name in group.layer_names)

    def group_of(self, layer_name: str) -> int:
        """Index into `groups` of the group holding `layer_name`; ValueError if no group does."""
        for index, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return index
        raise ValueError(
            f"layer {layer_name!r} is not in the KV cache config "
            f"(layers: {', '.join(self.layer_names)})"
        )


def group_layers(layer_specs: Mapping[str, AttentionSpec]) -> tuple[KVCacheGroup, ...]:
    """Put layers with equal specs in one group; groups in order of first appearance.

    Example: {"a": full, "b": window8, "c": full} -> (KVCacheGroup(full, ("a", "c")),
    KVCacheGroup(window8, ("b",))).
    """
    by_spec: dict[AttentionSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    return tuple(KVCacheGroup(spec, tuple(names)) for spec, names in by_spec.items())


def make_kv_cache_config(
    layer_specs: Mapping[str, AttentionSpec],
    memory_bytes: int,
    draft_layer_names: Iterable[str] = (),
) -> KVCacheConfig:
    """Size the cache: every layer gets num_blocks pages, so one block costs the sum of all
    layers' page sizes and num_blocks = memory_bytes // that sum.

    Example: 3 layers of 256-byte pages -> 768 bytes per block; 10_000 bytes -> 13 blocks.
    Raises ValueError when fewer than 2 blocks fit (block 0 is reserved) or a draft layer name is
    not in layer_specs. Does not check the draft layers' groups: see validate_same_kv_cache_group.
    """
    if not layer_specs:
        raise ValueError("cannot build a KV cache config without layers")
    drafts = tuple(draft_layer_names)
    missing = [name for name in drafts if name not in layer_specs]
    if missing:
        raise ValueError(f"draft layers not in layer_specs: {', '.join(missing)}")
    bytes_per_block = sum(spec.page_size_bytes for spec in layer_specs.values())
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise KVCacheBudgetError(
            f"KV cache budget of {memory_bytes} bytes holds {num_blocks} blocks of "
            f"{bytes_per_block} bytes ({len(layer_specs)} layers); at least {MIN_NUM_BLOCKS} "
            f"blocks are needed (block 0 is reserved), i.e. a budget of at least "
            f"{MIN_NUM_BLOCKS * bytes_per_block} bytes"
        )
    return KVCacheConfig(num_blocks, group_layers(layer_specs), drafts)


def validate_same_kv_cache_group(
    kv_cache_config: KVCacheConfig, draft_layer_names: Iterable[str] | None = None
) -> None:
    """Check that all draft layers sit in ONE KV cache group; pure check, mutates nothing.

    The proposer builds one attention-metadata object (one block table) for all draft layers,
    which is only right if they share a group. draft_layer_names None means the config's own.
    Raises KVCacheGroupError naming every draft layer with its group index and spec, or naming
    the draft layers the config lacks. No draft layers: nothing to check.
    """
    names = kv_cache_config.draft_layer_names if draft_layer_names is None else tuple(
        draft_layer_names
    )
    if not names:
        return
    known = set(kv_cache_config.layer_names)
    missing = [name for name in names if name not in known]
    if missing:
        raise KVCacheGroupError(
            f"draft layers missing from the KV cache config: {', '.join(missing)} "
            f"(layers: {', '.join(kv_cache_config.layer_names)})"
        )
    group_ids = {name: kv_cache_config.group_of(name) for name in names}
    if len(set(group_ids.values())) == 1:
        return
    placement = "; ".join(  # the cache's names are offset past the target's layers
        f"{name} (draft layer {i}) -> group {gid} ({kv_cache_config.groups[gid].spec})"
        for i, (name, gid) in enumerate(group_ids.items())
    )
    raise KVCacheGroupError(
        f"all draft layers must share one KV cache group (one block table, one spec), but they "
        f"span groups {sorted(set(group_ids.values()))}: {placement}"
    )
