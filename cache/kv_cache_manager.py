"""Per-request block tables over one BlockPool, with automatic prefix caching.

A request's block table covers its tokens in order; token ``t`` lives in block
``table[t // block_size]`` at offset ``t % block_size``:

    tokens   |0 ........ 15|16 ....... 31|32 .. 37      |
    table    [  block 7    ,  block 3    ,  block 12    ]
              full, hashed   full, hashed   partial, not hashed yet

Only full blocks are hashed (chained on the previous block's hash), so a hit on block ``i``
implies the whole prefix up to and including block ``i`` matched.

With a ``sliding_window`` (a model whose every layer attends that many tokens back only, Mistral-7B-v0.1's), the
blocks wholly behind the window of a request's next token go back to the pool as the window moves; their table
entries become the null block (the windowed kernels never read a page before the window). A freed block keeps its
hash until it is reused, so another request's prefix can still hit it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens


def cached_runs(found: Sequence[KVBlock | None]) -> list[int]:
    """For each block of a lookup, how many cached blocks end there in a row."""
    runs, run = [], 0
    for block in found:
        run = run + 1 if block is not None else 0
        runs.append(run)
    return runs


class PoolCounters:
    """What a manager over `self.block_pool` reports (a group's, or the hybrid one over several groups): its free
    blocks, their use, the prefix cache's hit rate (`prefix_cache_queries` / `prefix_cache_hits`, in tokens)."""

    block_pool: BlockPool
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request, in [0, 1]."""
        usable = self.block_pool.num_usable_blocks
        return (usable - self.num_free_blocks) / usable

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate in tokens; 0.0 before any query."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes if no block is in use; returns whether it did."""
        return self.block_pool.reset_prefix_cache()


class KVCacheManager(PoolCounters):
    """Per-request block tables over one BlockPool, with automatic prefix caching.

    Usage by the scheduler, for a request's first allocation:

        blocks, num_computed_tokens = manager.get_computed_blocks(token_ids)
        ok = manager.allocate_slots(req_id, token_ids, num_computed_tokens, num_new_tokens, blocks)

    with no other allocation in between (another allocation could evict the hit blocks).
    Later steps call ``allocate_slots`` without ``new_computed_blocks``; ``free`` releases all.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int = 0,
        block_pool: BlockPool | None = None,
        hash_root: BlockHash | None = None,
        pages_per_block: int = 1,
    ) -> None:
        """`block_pool`: a pool shared with other managers (hybrid.py's groups), each hashing its blocks from its
        own `hash_root` (its blocks hold other layers' KV, so the same tokens must not hit another group's).
        `pages_per_block`: k where the group's layers see each block as k pages (groups.py): its tables hold k * b."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = block_pool if block_pool is not None else BlockPool(num_blocks, enable_prefix_caching)
        self.hash_root = hash_root
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same tables as physical ids (pages), kept in step
        self.pages_per_block = pages_per_block
        # Hash chain of each request's full blocks, so every block is hashed once.
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.sliding_window = sliding_window
        self.req_to_freed: dict[str, int] = {}  # how many of a request's first blocks are behind its window, freed
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVBlock], int]:
        """Longest chain of cached full blocks matching a prefix of ``token_ids``.

        At most ``(len(token_ids) - 1) // block_size`` blocks, so at least one token is left to
        compute (the forward pass must produce logits for the last one). Returns the blocks and
        ``num_computed_tokens = len(blocks) * block_size``. Does not change ref counts; pass the
        blocks to ``allocate_slots`` to take them. ``([], 0)`` with prefix caching off.
        With a sliding window a hit needs only the blocks inside the next token's window: those before it
        are the null block in the returned list (their KV is never read).
        """
        if not self.enable_prefix_caching:
            return [], 0
        found = self.lookup(token_ids)
        runs = cached_runs(found)
        blocks = next((b for n in range(len(found), 0, -1) if (b := self.hit(found, runs, n)) is not None), [])
        num_computed_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_computed_tokens
        return blocks, num_computed_tokens

    def lookup(self, token_ids: Sequence[int]) -> list[KVBlock | None]:
        """The cached block of each full block of ``token_ids`` short of the last token, None where there is none;
        without a window it stops at the first miss (a hit needs every block before it)."""
        if not self.enable_prefix_caching:
            return []
        found: list[KVBlock | None] = []
        parent_hash = self.hash_root
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            parent_hash = hash_block_tokens(parent_hash, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.block_pool.get_cached_block(parent_hash)
            if block is None and not self.sliding_window:
                break
            found.append(block)
        return found

    def hit(self, found: list[KVBlock | None], runs: list[int], n: int) -> list[KVBlock] | None:
        """The blocks of a hit on the first `n` blocks (`found` from `lookup`, `runs` its `cached_runs`), or None
        where the cache does not hold it: every block; with a window, those the next token's window covers (the
        null block before them)."""
        if n > len(found):
            return None
        first = max(n * self.block_size - self.sliding_window + 1, 0) // self.block_size if self.sliding_window else 0
        if runs[n - 1] < n - first:
            return None
        return [self.block_pool.null_block] * first + found[first:n]

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Grow the request's block table to cover ``num_computed_tokens + num_new_tokens`` tokens, and
        ``num_lookahead_tokens`` past them (a draft chain's positions: slots the step's forward does not write).

        ``token_ids`` holds every token known now (prompt + outputs so far);
        ``num_computed_tokens`` includes the tokens covered by ``new_computed_blocks``, which are
        passed only on a request's first allocation, straight from ``get_computed_blocks``.

        Returns False and changes nothing if the pool is short of blocks. Otherwise takes the
        computed blocks, then fresh ones, and caches every block that is now full within the
        step's tokens.
        """
        if self.sliding_window and request_id in self.req_to_blocks:  # (first: this step's new blocks may reuse them)
            self.free_behind_window(request_id, num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id, [])
        if new_computed_blocks and blocks:
            raise ValueError(f"request {request_id!r} already has blocks; prefix hits come first")
        num_required_tokens = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        # (only blocks the step fills are hashed: a lookahead position's KV is not the model's until a step computes it)
        num_full_blocks = min(num_computed_tokens + num_new_tokens, len(token_ids)) // self.block_size
        num_hashed = len(self.req_to_block_hashes.get(request_id, ()))
        if num_required_tokens <= len(blocks) * self.block_size and not (
            self.enable_prefix_caching and num_full_blocks > num_hashed
        ):
            return True  # most decode steps: the slot exists and no block fills up
        num_required_blocks = -(-num_required_tokens // self.block_size)
        num_new_blocks = max(num_required_blocks - len(blocks) - len(new_computed_blocks), 0)
        # Hit blocks sitting in the free queue are counted as free but are about to be taken.
        null = self.block_pool.null_block
        num_hit_blocks_free = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null)
        if num_new_blocks > self.num_free_blocks - num_hit_blocks_free:
            return False

        block_hashes = self.req_to_block_hashes.get(request_id, [])
        # Touch before taking fresh blocks so get_new_blocks cannot evict the hit blocks.
        behind = sum(1 for block in new_computed_blocks if block is null)  # (a windowed hit's, all first)
        self.block_pool.touch(new_computed_blocks[behind:])
        parent_hash = self.hash_root
        for i, block in enumerate(new_computed_blocks):
            if i < behind:  # (the chain goes on through them: their hashes from the tokens)
                tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
                parent_hash = hash_block_tokens(parent_hash, tokens)
            else:
                assert block.block_hash is not None, "hit block was evicted before allocate_slots"
                parent_hash = block.block_hash
            block_hashes.append(parent_hash)
        if behind:
            self.req_to_freed[request_id] = behind
        new_blocks = [*new_computed_blocks, *self.block_pool.get_new_blocks(num_new_blocks)]
        blocks.extend(new_blocks)
        self.req_to_blocks[request_id] = blocks
        pages = self.pages_per_block
        self.req_to_block_ids.setdefault(request_id, []).extend(block.block_id * pages for block in new_blocks)
        self.req_to_block_hashes[request_id] = block_hashes

        if self.enable_prefix_caching:
            # NOTE: blocks are cached before the forward writes their KV. A request hitting them
            # in the same step is safe because each layer writes the step's KV before attending.
            # Hazard: freeing this request before that forward runs (preempting it in the same
            # schedule call) would leave hashes on blocks whose KV was never written.
            self._cache_full_blocks(token_ids, blocks, block_hashes, num_full_blocks)
        if self.sliding_window:
            self.free_behind_window(request_id, num_computed_tokens)
        return True

    def blocks_needed(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> int:
        """How many of the pool's free blocks `allocate_slots` with these arguments would take, less those its
        window gives back first (hit blocks sitting in the free queue count as taken)."""
        blocks = self.req_to_blocks.get(request_id, [])
        num_required_blocks = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        taken = max(num_required_blocks - len(blocks) - len(new_computed_blocks), 0)
        null = self.block_pool.null_block
        taken += sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null)
        if self.sliding_window and blocks:
            behind = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
            freed = self.req_to_freed.get(request_id, 0)
            taken -= sum(1 for block in blocks[freed:behind] if block.ref_cnt == 1)
        return taken

    def free_behind_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks wholly before the window of the request's next token (position `num_computed_tokens`,
        which sees the keys from num_computed_tokens - window + 1 on)."""
        behind = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        freed = self.req_to_freed.get(request_id, 0)
        if behind <= freed:
            return
        blocks, ids = self.req_to_blocks[request_id], self.req_to_block_ids[request_id]
        null = self.block_pool.null_block
        # NOTE: an in-flight step may still read these; it runs on the stream before any later step's write to a
        # block handed out again from here
        self.block_pool.free_blocks(blocks[freed:behind])
        for i in range(freed, behind):
            blocks[i], ids[i] = null, null.block_id * self.pages_per_block
        self.req_to_freed[request_id] = behind

    def quiet_limits(self, request_id: str) -> tuple[int, int]:
        """Up to how many tokens in all, and how many computed ones, the request's next allocations leave it as it
        is: no new block, no block newly full to hash (nor its hash chain), none behind the window to free (the next
        block leaves the window when the computed tokens pass its end + window - 1)."""
        size = self.block_size
        tokens = len(self.req_to_blocks[request_id]) * size
        if self.enable_prefix_caching:
            tokens = min(tokens, (len(self.req_to_block_hashes[request_id]) + 1) * size - 1)
        if not self.sliding_window:
            return tokens, tokens
        return tokens, (self.req_to_freed.get(request_id, 0) + 1) * size + self.sliding_window - 2

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first so it is evicted first. Unknown id: no-op."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_block_ids.pop(request_id, None)
        self.req_to_block_hashes.pop(request_id, None)
        freed = self.req_to_freed.pop(request_id, 0)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks[freed:]))  # (the first `freed` went back as the window moved)

    def uncache(self, request_id: str) -> None:
        """Make the request's blocks undiscoverable by prefix lookups, e.g. after a forward pass that
        failed midway: blocks are hashed when allocated, before their KV is written."""
        self.block_pool.uncache(self.req_to_blocks.get(request_id, [])[self.req_to_freed.get(request_id, 0) :])

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids (times `pages_per_block`: the first page of each); []
        for an unknown request. The list is the manager's own (it grows as the request does): read it, never
        modify it."""
        return self.req_to_block_ids.get(request_id, [])

    def _cache_full_blocks(
        self,
        token_ids: Sequence[int],
        blocks: list[KVBlock],
        block_hashes: list[BlockHash],
        num_full_blocks: int,
    ) -> None:
        # block_hashes[i] is the hash of blocks[i]'s content; extend the chain where it stops.
        for i in range(len(block_hashes), num_full_blocks):
            parent_hash = block_hashes[-1] if block_hashes else self.hash_root
            block_tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block_tokens(parent_hash, block_tokens)
            # (a prompt's first block has no parent in its KV event, whatever the group's root)
            self.block_pool.cache_block(blocks[i], block_hash, block_hashes[-1] if block_hashes else None, block_tokens)
            block_hashes.append(block_hash)
