"""Paged KV cache: specs, layer grouping, block pool, per-request block tables, cache tensors.

Everything here is pure Python except cache.py, which is the one module that imports torch:
  spec.py        AttentionSpec (frozen; knows its page size)
  groups.py      KV cache groups, KVCacheConfig, the draft-layer group check
  block_pool.py  blocks, ref counts, LRU free queue, prefix cache by chained block hash
  manager.py     KVCacheManager: one block table per request
  cache.py       cache tensors and slot mapping
"""
