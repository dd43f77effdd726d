"""Physical KV blocks: a pool with reference counts, prefix-cache hashes and LRU eviction.

A block is in exactly one of three states:

    in use       ref_cnt > 0                 owned by one or more requests' block tables
    free+cached  ref_cnt == 0, has a hash    reusable as is by a prefix hit, or evicted when taken
    free         ref_cnt == 0, no hash       plain free block

Free blocks (cached or not) sit in one queue in eviction order: the head is handed out first,
freed blocks join the tail. A prefix hit on a free+cached block takes it out of the queue.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.cache.kv_events import KVEventLog

BlockHash = bytes

# Stands in for the parent hash of a request's first block, so every block hashes the same shape
# of input and a first block can never collide with a later block of the same tokens.
_ROOT_HASH: BlockHash = hashlib.sha256(b"kiln.cache.block_pool.root").digest()

# Block 0 is reserved: padded token slots (CUDA-graph padding, unused batch rows) write their KV
# there, so it is never handed to a request and never freed.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: sha256(parent hash or root marker || tokens as int64 LE).

    Two blocks share a hash exactly when they hold the same tokens after the same prefix, which
    is what makes their KV interchangeable.
    """
    hasher = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    # Fixed little-endian int64 so hashes do not depend on the host or on Python int widths.
    hasher.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return hasher.digest()


@dataclass(eq=False)
class KVBlock:
    """One physical block of the KV cache. Identity, not value, equality (blocks are unique)."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the pool's prefix cache; cleared on eviction.
    block_hash: BlockHash | None = None


class BlockPool:
    """Hands out blocks ``1 .. num_blocks-1`` with ref counts; keeps full blocks findable by hash.

    Contract: every block obtained from ``get_new_blocks`` or ``touch`` is released with exactly
    one ``free_blocks`` call per reference. Not thread-safe (the scheduler owns it).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks never handed out yet are the free queue's head, in id order; each is made when first taken
        # (`blocks` grows): a small model on a large GPU has hundreds of thousands, too many to make at start-up.
        self.blocks = [KVBlock(NULL_BLOCK_ID)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # The rest of the queue: blocks freed since, oldest first. OrderedDict gives O(1) removal from the middle
        # when a prefix hit revives a free block.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached_blocks: dict[BlockHash, KVBlock] = {}
        self.kv_events: KVEventLog | None = None  # the hash map's changes, once `record_kv_events` is called

    def record_kv_events(self) -> KVEventLog:
        """From now on, log every change of the prefix cache's hashes as vLLM's KV-cache events (kv_events.py)."""
        if self.kv_events is None:
            self.kv_events = KVEventLog()
        return self.kv_events

    @property
    def num_usable_blocks(self) -> int:
        """All blocks except the reserved null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not (a cached free block is reusable by eviction)."""
        return self.num_blocks - len(self.blocks) + len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their hashes; ref_cnt = 1.

        Raises ValueError (taking nothing) if fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        fresh = min(n, self.num_blocks - len(self.blocks))
        new_blocks = [KVBlock(block_id, ref_cnt=1) for block_id in range(len(self.blocks), len(self.blocks) + fresh)]
        self.blocks += new_blocks
        for _ in range(n - fresh):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash``, in use or free; None if not cached."""
        return self._cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block; a free block leaves the free queue (a prefix hit)."""
        for block in blocks:
            self._check_not_null(block)
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each block; at zero it joins the free TAIL, keeping its hash.

        Callers pass a request's blocks in reverse so its last blocks are evicted before its
        first ones: the longest shared prefixes survive longest.
        """
        for block in blocks:
            self._check_not_null(block)
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more times than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register a full block under ``block_hash`` so later requests can reuse its KV.

        If another block already holds this hash, the existing mapping wins and ``block`` simply
        stays uncached (it is freed like any plain block). A block already cached is left alone.
        No-op with prefix caching off. `parent_hash` (None for a prompt's first block) and the block's
        `token_ids` are what its KV event carries.
        """
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        self._check_not_null(block)
        if block_hash in self._cached_blocks:
            return
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block
        if self.kv_events is not None:
            self.kv_events.stored(block_hash, parent_hash, token_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, if no block is in use; returns whether it did."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the hashes of these blocks (in use or not): their KV can no longer be trusted."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        # Only the holder of a hash carries it (cache_block never maps a second block to it).
        del self._cached_blocks[block.block_hash]
        if self.kv_events is not None:
            self.kv_events.removed(block.block_hash)
        block.block_hash = None

    def _check_not_null(self, block: KVBlock) -> None:
        if block.block_id == NULL_BLOCK_ID:
            raise ValueError("block 0 is the reserved null block; it is never referenced or freed")
