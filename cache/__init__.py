"""Paged KV cache: block pool, per-request block tables with prefix caching, and sizing."""

from __future__ import annotations

from kiln.cache.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, KVBlock, hash_block_tokens
from kiln.cache.groups import KVGroups, kv_groups
from kiln.cache.hybrid import HybridKVCacheManager, make_kv_cache_manager
from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.cache.sizing import KVCacheSpec, allocate_kv_caches, gpu_kv_budget_bytes, num_blocks_for_budget
from kiln.cache.state_cache import RecurrentStateCache, StateKVCacheManager

__all__ = [
    "NULL_BLOCK_ID",
    "RecurrentStateCache",
    "StateKVCacheManager",
    "BlockHash",
    "BlockPool",
    "HybridKVCacheManager",
    "KVBlock",
    "KVCacheManager",
    "KVCacheSpec",
    "KVGroups",
    "allocate_kv_caches",
    "gpu_kv_budget_bytes",
    "hash_block_tokens",
    "kv_groups",
    "make_kv_cache_manager",
    "num_blocks_for_budget",
]
