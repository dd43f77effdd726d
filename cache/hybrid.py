"""A request's block tables in each of the layers' KV groups (groups.py), over one shared BlockPool.

The scheduler sees one manager, as with a single group: an allocation takes every group's blocks or none, a prefix
hit is the longest prefix every group has cached, and `block_ids` is a request's table in each group (the input
writer gives each group's layers theirs). Each group is a KVCacheManager of its own on the shared pool: the full
group keeps every block, a sliding group frees those behind its window as it moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kiln.cache.block_pool import BlockPool, KVBlock
from kiln.cache.groups import KVGroups
from kiln.cache.kv_cache_manager import KVCacheManager, PoolCounters, cached_runs


class HybridKVCacheManager(PoolCounters):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, groups: KVGroups) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.managers = [
            KVCacheManager(
                num_blocks,
                block_size,
                enable_prefix_caching,
                window,
                self.block_pool,
                hashlib.sha256(f"kiln.cache.hybrid.group{g}".encode()).digest(),
                groups.group_pages(g),
            )
            for g, window in enumerate(groups.windows)
        ]
        self._sliding = [manager for manager in self.managers if manager.sliding_window]
        self._tables: dict[str, list[list[int]]] = {}  # each request's tables, the managers' own lists
        self._quiet: dict[str, tuple[int, int]] = {}  # each request's `_quiet_limits`
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[list[KVBlock]], int]:
        """Each group's cached blocks of the longest prefix of `token_ids` that every group holds (as
        KVCacheManager's: a whole number of blocks, short of the last token; a sliding group needs only those in the
        next token's window), and its length in tokens."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.managers], 0
        found = [manager.lookup(token_ids) for manager in self.managers]
        runs = [cached_runs(f) for f in found]
        hits: list[list[KVBlock]] = [[] for _ in self.managers]
        for n in range(min(len(f) for f in found), 0, -1):
            each = [manager.hit(f, r, n) for manager, f, r in zip(self.managers, found, runs)]
            if all(blocks is not None for blocks in each):
                hits = each
                break
        num_tokens = len(hits[0]) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_tokens
        return hits, num_tokens

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVBlock]] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Every group's slots for the tokens (KVCacheManager.allocate_slots), or none: False, nothing taken, when
        the pool is short of what they need together."""
        quiet = self._quiet.get(request_id)
        if quiet is not None and num_computed_tokens + num_new_tokens + num_lookahead_tokens <= quiet[0]:
            if num_computed_tokens <= quiet[1]:
                return True  # most decode steps: no group takes, hashes or frees a block
            for manager in self._sliding:  # only windows move: each frees what left it, and none takes a block
                manager.free_behind_window(request_id, num_computed_tokens)
            self._quiet[request_id] = self._quiet_limits(request_id)
            return True
        hits = new_computed_blocks or [()] * len(self.managers)
        needed = sum(
            manager.blocks_needed(request_id, num_computed_tokens, num_new_tokens + num_lookahead_tokens, blocks)
            for manager, blocks in zip(self.managers, hits)
        )
        if needed > self.num_free_blocks:
            return False
        # NOTE: every group's hit blocks are taken first: one group's fresh blocks would otherwise evict another's hits
        # from the free queue (each group then takes its own reference, and this one is dropped)
        null = self.block_pool.null_block
        held = [block for blocks in hits for block in blocks if block is not null]
        self.block_pool.touch(held)
        for manager, blocks in zip(self.managers, hits):
            allocated = manager.allocate_slots(
                request_id, token_ids, num_computed_tokens, num_new_tokens, blocks, num_lookahead_tokens
            )
            assert allocated, "a group's allocation failed after the pool was found to hold them all"
        self.block_pool.free_blocks(held)
        if request_id not in self._tables:
            self._tables[request_id] = [manager.block_ids(request_id) for manager in self.managers]
        self._quiet[request_id] = self._quiet_limits(request_id)
        return True

    def _quiet_limits(self, request_id: str) -> tuple[int, int]:
        """Up to how many tokens in all and how many computed ones the request's next allocations change nothing in
        any group (KVCacheManager.quiet_limits, the least over the groups)."""
        limits = [manager.quiet_limits(request_id) for manager in self.managers]
        return min(tokens for tokens, _ in limits), min(computed for _, computed in limits)

    def free(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        self._quiet.pop(request_id, None)
        for manager in self.managers:
            manager.free(request_id)

    def uncache(self, request_id: str) -> None:
        for manager in self.managers:
            manager.uncache(request_id)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (the managers' own lists: read them, never modify them)."""
        return self._tables.get(request_id, [[] for _ in self.managers])


def make_kv_cache_manager(
    num_blocks: int, block_size: int, enable_prefix_caching: bool, groups: KVGroups
) -> KVCacheManager | HybridKVCacheManager:
    """One group's manager (its window, if every layer slides), or the hybrid one over several groups."""
    if groups.num_groups == 1:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching, groups.windows[0])
    return HybridKVCacheManager(num_blocks, block_size, enable_prefix_caching, groups)
