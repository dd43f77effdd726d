"""BlockPool: reserved null block, ref counts, free order, LRU eviction of cached blocks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kiln.cache import NULL_BLOCK_ID, BlockPool, hash_block_tokens


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def test_hash_is_sha256_of_parent_and_int64_tokens():
    parent = b"\x01" * 32
    expected = hashlib.sha256(parent + np.array([1, 2, 3], dtype="<i8").tobytes()).digest()
    assert hash_block_tokens(parent, [1, 2, 3]) == expected


def test_hash_chain_depends_on_tokens_and_parent():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, (1, 2, 3, 4))  # any sequence type
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    assert child == hash_block_tokens(root, [5, 6, 7, 8])
    assert child != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    # A first block and a later block with the same tokens differ (root marker vs real parent).
    assert hash_block_tokens(None, [5, 6, 7, 8]) != child
    # Tokens past int32 must not wrap.
    assert hash_block_tokens(None, [2**32]) != hash_block_tokens(None, [0])


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(ids(blocks)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.free_blocks([pool.blocks[NULL_BLOCK_ID]])
    with pytest.raises(ValueError):
        pool.touch([pool.blocks[NULL_BLOCK_ID]])


def test_errors():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)
    pool = BlockPool(num_blocks=4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)  # only 3 usable
    assert pool.num_free_blocks == 3  # a failed request takes nothing
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])  # double free


def test_ref_counts_and_free_order():
    pool = BlockPool(num_blocks=6)
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2]  # handed out from the head, in id order at start
    assert all(block.ref_cnt == 1 for block in first)
    pool.touch(first)
    assert [block.ref_cnt for block in first] == [2, 2]
    pool.free_blocks(first)
    assert pool.num_free_blocks == 3  # still referenced once each
    pool.free_blocks(reversed(first))
    assert pool.num_free_blocks == 5
    # Remaining fresh blocks 3, 4, 5 come first, then the freed ones in the order freed (2, then 1).
    assert ids(pool.get_new_blocks(5)) == [3, 4, 5, 2, 1]


def test_cached_free_block_is_evicted_lru():
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    hash_a, hash_b = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(a, hash_a)
    pool.cache_block(b, hash_b)
    pool.free_blocks([a])
    pool.free_blocks([c])
    pool.free_blocks([b])  # free order a, c, b: a is least recently used
    assert pool.num_free_blocks == 3  # cached-but-unreferenced blocks count as free
    assert pool.get_cached_block(hash_a) is a
    (taken,) = pool.get_new_blocks(1)
    assert taken is a and a.block_hash is None and a.ref_cnt == 1
    assert pool.get_cached_block(hash_a) is None  # evicted
    assert pool.get_cached_block(hash_b) is b  # freed last, evicted last
    assert ids(pool.get_new_blocks(2)) == [c.block_id, b.block_id]
    assert pool.get_cached_block(hash_b) is None


def test_touch_revives_cached_free_block():
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    block_hash = hash_block_tokens(None, [7, 7])
    pool.cache_block(b, block_hash)
    pool.free_blocks([c, b, a])
    hit = pool.get_cached_block(block_hash)
    assert hit is b
    pool.touch([hit])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    # b left the free queue: the next two blocks are c and a, and b keeps its hash.
    assert ids(pool.get_new_blocks(2)) == [c.block_id, a.block_id]
    assert pool.get_cached_block(block_hash) is b
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_duplicate_hash_keeps_first_mapping():
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [3])
    pool.cache_block(a, block_hash)
    pool.cache_block(b, block_hash)
    assert pool.get_cached_block(block_hash) is a
    assert b.block_hash is None
    # Evicting the uncached duplicate must not disturb the real holder.
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # takes block 3 then b
    assert pool.get_cached_block(block_hash) is a


def test_prefix_caching_off_caches_nothing():
    pool = BlockPool(num_blocks=3, enable_prefix_caching=False)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1])
    pool.cache_block(block, block_hash)
    assert pool.get_cached_block(block_hash) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [9])
    pool.cache_block(a, block_hash)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()  # b still in use
    assert pool.get_cached_block(block_hash) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(block_hash) is None and a.block_hash is None
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3
