"""Recurrent-state slots (Gated DeltaNet layers) beside the KV blocks, and snapshots of them for prefix hits.

A linear-attention layer keeps no per-token K/V: a request's whole past is one fixed-size state a layer (a conv
window and a delta-rule matrix per head). Every layer's state tensors have the same rows, handed out here:

    row 0                         scratch: padded requests of a CUDA-graph batch write there
    rows 1 .. num_slots           one a running request, taken at its first step, freed on finish, abort, preemption
    rows num_slots + 1 .. end     snapshots: a state as it was after a block boundary, keyed by that block's hash

A prefix hit needs the state at the hit's end, and a state cannot be rewound, so snapshots are taken where the
scheduler makes a step end on a block boundary (`chunk_end`): the last full block of what a request has to compute
(the prompt's, which is what the next turn of a conversation starts with) and the ends of chunked prefill's
chunks. A hit (`StateKVCacheManager.get_computed_blocks`) is the longest run of cached KV blocks whose last block has
a snapshot; the request's slot is filled from it before its first step. Snapshots are evicted least recently used.

The cache only names rows: `copies()` says which rows the model runner copies to which, before the step's forward
(a hit's snapshot into its slot) and after it (a slot into a snapshot).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kiln.cache.block_pool import BlockHash, KVBlock
from kiln.cache.kv_cache_manager import KVCacheManager

StateCopies = tuple[list[tuple[int, int]], list[tuple[int, int]]]  # (before the forward, after it): (from, to) rows


class RecurrentStateCache:
    def __init__(self, num_slots: int, num_snapshots: int) -> None:
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        first_snapshot = num_slots + 1
        self.free_slots = list(range(num_slots, 0, -1))  # (popped from the end: low rows first)
        self.free_snapshots = list(range(first_snapshot + num_snapshots - 1, first_snapshot - 1, -1))
        self.slot_of: dict[str, int] = {}
        self.snapshots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._before: list[tuple[int, int]] = []
        self._after: list[tuple[int, int]] = []
        self._pending: set[BlockHash] = set()  # snapshots the coming step writes: no hit may read them before it

    @property
    def num_rows(self) -> int:
        """Rows every state tensor needs: scratch, slots, snapshots."""
        return 1 + self.num_slots + self.num_snapshots

    def has_free_slot(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, request_id: str) -> int:
        slot = self.slot_of[request_id] = self.free_slots.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (unknown id: no-op). NOTE: a step in flight may still write it; a later
        step's request taking it does not read it before writing (its context starts empty, or from a snapshot copied
        after that step on the same stream)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def snapshot_of(self, block_hash: BlockHash) -> int | None:
        """The snapshot after the block of this hash, marked recently used; None if there is none."""
        row = None if block_hash in self._pending else self.snapshots.get(block_hash)
        if row is not None:
            self.snapshots.move_to_end(block_hash)
        return row

    def restore(self, request_id: str, block_hash: BlockHash) -> None:
        """Before the next forward, fill the request's slot from the snapshot after `block_hash`."""
        self._before.append((self.snapshots[block_hash], self.slot_of[request_id]))
        self.snapshots.move_to_end(block_hash)

    def snapshot(self, request_id: str, block_hash: BlockHash) -> None:
        """After the next forward, keep the request's state (then just past `block_hash`'s block) as that block's
        snapshot, evicting the least recently used one if none is free."""
        if not self.num_snapshots or block_hash in self.snapshots:
            if block_hash in self.snapshots:
                self.snapshots.move_to_end(block_hash)
            return
        if self.free_snapshots:
            row = self.free_snapshots.pop()
        else:
            _, row = self.snapshots.popitem(last=False)
            # a restore from this row queued for the coming step still reads it first: it runs before the forward
        self.snapshots[block_hash] = row
        self._pending.add(block_hash)
        self._after.append((self.slot_of[request_id], row))

    def copies(self) -> StateCopies:
        """The copies queued since the last call, for the step about to run."""
        before, after = self._before, self._after
        self._before, self._after = [], []
        self._pending.clear()
        return before, after

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        """Forget the snapshots of these blocks (a step that was to write them failed)."""
        for block_hash in block_hashes:
            row = self.snapshots.pop(block_hash, None)
            if row is not None:
                self.free_snapshots.append(row)

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self.free_snapshots += self.snapshots.values()
        self.snapshots.clear()


class StateKVCacheManager:
    """The KV manager of a hybrid model's attention layers, with the recurrent-state slots beside it: the scheduler's
    one manager. A request's allocation takes a state slot with its first blocks (or fails as a short pool does);
    `free` gives both back; a prefix hit reaches only as far as a snapshot does."""

    def __init__(self, kv: KVCacheManager, states: RecurrentStateCache) -> None:
        self.kv, self.states = kv, states
        self.block_size = kv.block_size
        self.enable_prefix_caching = kv.enable_prefix_caching

    def __getattr__(self, name: str):  # the KV manager's counters and views (num_free_blocks, usage, block_ids, ...)
        return getattr(self.kv, name)

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVBlock], int]:
        blocks, num_tokens = self.kv.get_computed_blocks(token_ids)
        hit = next((n for n in range(len(blocks), 0, -1) if self.states.snapshot_of(blocks[n - 1].block_hash)), 0)
        self.kv.prefix_cache_hits -= num_tokens - hit * self.block_size
        return blocks[:hit], hit * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        first = request_id not in self.states.slot_of
        if first and not self.states.has_free_slot():
            return False
        if not self.kv.allocate_slots(
            request_id, token_ids, num_computed_tokens, num_new_tokens, new_computed_blocks, num_lookahead_tokens
        ):
            return False
        if first:
            self.states.allocate(request_id)
            if new_computed_blocks:
                self.states.restore(request_id, new_computed_blocks[-1].block_hash)
        return True

    def chunk_end(self, request_id: str, num_computed_tokens: int, num_new_tokens: int, num_tokens: int) -> int:
        """How many of `num_new_tokens` to compute this step so that, where the step can end on a block boundary at
        or before the request's last full block, it does (its state is then kept as a snapshot there)."""
        if not self.enable_prefix_caching or not self.states.num_snapshots:
            return num_new_tokens
        size = self.block_size
        end = num_computed_tokens + num_new_tokens
        last_full = num_tokens // size * size
        if num_computed_tokens < last_full < end:
            return last_full - num_computed_tokens  # the rest of the prompt (or recompute) next step
        boundary = end // size * size
        if end < num_tokens and boundary > num_computed_tokens:  # a chunk cut short by the budget
            return boundary - num_computed_tokens
        return num_new_tokens

    def after_schedule(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> None:
        """A request was scheduled for these tokens: a chunk of several that ends on a block boundary leaves a
        snapshot there (its KV block is hashed by now)."""
        end = num_computed_tokens + num_new_tokens
        if num_new_tokens < 2 or end % self.block_size or not self.enable_prefix_caching:
            return
        hashes = self.kv.req_to_block_hashes.get(request_id, ())
        if len(hashes) >= end // self.block_size:
            self.states.snapshot(request_id, hashes[end // self.block_size - 1])

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.states.free(request_id)

    def uncache(self, request_id: str) -> None:
        """After a failed forward: neither its blocks nor the snapshots it was to write can be hit."""
        self.states.drop(self.kv.req_to_block_hashes.get(request_id, ()))
        self.kv.uncache(request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.kv.reset_prefix_cache():
            return False
        self.states.reset()
        return True
