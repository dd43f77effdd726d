"""The block pool's KV-cache events: a hash registered, evicted, uncached or cleared is one event, in vLLM's array
layout, and a request's new blocks travel as one BlockStored chained to its parent."""

from __future__ import annotations

from kiln.cache import KVCacheManager, hash_block_tokens
from kiln.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

BS = 4


def manager(num_blocks: int = 8) -> tuple[KVCacheManager, object]:
    kv = KVCacheManager(num_blocks, BS)
    return kv, kv.block_pool.record_kv_events()


def chain(tokens: list[int]) -> list[int]:
    """The events' hashes of each full block of `tokens`."""
    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(external_hash(parent))
    return hashes


def run(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    blocks, computed = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(request_id, tokens, computed, len(tokens) - computed, blocks)


def test_a_prompts_full_blocks_are_one_stored_event():
    kv, log = manager()
    tokens = list(range(10))  # two full blocks and two tokens
    run(kv, "a", tokens)
    assert log.take() == [BlockStored(chain(tokens), None, tokens[:8], BS)]
    assert log.take() == []


def test_blocks_filled_later_chain_to_their_parent():
    kv, log = manager()
    tokens = list(range(6))
    run(kv, "a", tokens)
    first = log.take()
    tokens += [6, 7]  # decode fills the second block
    assert kv.allocate_slots("a", tokens, 6, 2)
    parent, child = chain(tokens)
    assert first == [BlockStored([parent], None, [0, 1, 2, 3], BS)]
    assert log.take() == [BlockStored([child], parent, [4, 5, 6, 7], BS)]


def test_a_prefix_hit_stores_only_the_new_blocks():
    kv, log = manager()
    run(kv, "a", list(range(9)))
    log.take()
    run(kv, "b", [*range(8), 50, 51, 52, 53, 54])  # hits two blocks, fills a third
    hashes = chain([*range(8), 50, 51, 52, 53])
    assert log.take() == [BlockStored(hashes[2:], hashes[1], [50, 51, 52, 53], BS)]


def test_eviction_and_uncache_remove_and_a_reset_clears():
    kv, log = manager(num_blocks=4)  # three usable blocks
    first = list(range(9))
    run(kv, "a", first)
    kv.free("a")
    log.take()
    run(kv, "b", [100 + t for t in range(9)])  # takes all three blocks back: the cached two are evicted
    stored = chain([100 + t for t in range(9)])
    events = log.take()
    assert events[0] == BlockRemoved(list(reversed(chain(first))))  # (freed last block first: evicted first)
    assert events[1:] == [BlockStored(stored, None, [100 + t for t in range(8)], BS)]
    kv.uncache("b")
    assert log.take() == [BlockRemoved(stored)]
    kv.free("b")
    run(kv, "c", first)
    kv.free("c")
    log.take()
    assert kv.reset_prefix_cache()
    assert log.take() == [AllBlocksCleared()]


def test_a_hash_another_block_holds_is_not_stored_again():
    """Two requests computing the same block: the pool keeps the first, and so do the events."""
    kv, log = manager()
    tokens = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", tokens, 0, 5)  # (no lookup: both compute it)
    kv.allocate_slots("b", tokens, 0, 5)
    assert log.take() == [BlockStored(chain(tokens), None, [1, 2, 3, 4], BS)]


def test_the_wire_layouts_are_vllms():
    """vLLM's events now (tagged maps, vllm/distributed/kv_events.py at v0.34.0) and before its PR #42892 (arrays)."""
    stored = BlockStored([7, 8], 6, list(range(8)), 4)
    assert stored.wire() == {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": 6,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert BlockRemoved([7]).wire() == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert AllBlocksCleared().wire() == {"type": "AllBlocksCleared"}
    assert stored.wire("array") == ["BlockStored", [7, 8], 6, list(range(8)), 4, None, "GPU", None]
    assert BlockRemoved([7]).wire("array") == ["BlockRemoved", [7], "GPU"]
    assert AllBlocksCleared().wire("array") == ["AllBlocksCleared"]
    # vLLM's int hash: the digest's last 8 bytes as an unsigned big-endian integer
    assert external_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


def test_without_recording_nothing_is_kept():
    kv = KVCacheManager(8, BS)
    run(kv, "a", list(range(9)))
    assert kv.block_pool.kv_events is None
