"""KVCacheManager: block tables, atomic allocation, prefix hits, sharing, eviction, counters."""

from __future__ import annotations

import random

import pytest

from kiln.cache import KVCacheManager

BLOCK_SIZE = 4


def make(num_blocks: int = 10, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def prefill(manager: KVCacheManager, request_id: str, prompt: list[int]) -> int:
    """First allocation as the scheduler does it; returns the number of prefix-hit tokens."""
    blocks, num_computed = manager.get_computed_blocks(prompt)
    num_new = len(prompt) - num_computed
    assert manager.allocate_slots(request_id, prompt, num_computed, num_new, blocks)
    return num_computed


def test_allocation_across_block_boundaries():
    manager = make(num_blocks=10)
    assert manager.num_free_blocks == 9 and manager.usage == 0.0
    tokens = list(range(10))
    assert manager.allocate_slots("r", tokens, 0, 10)
    assert len(manager.block_ids("r")) == 3  # ceil(10 / 4)
    table = list(manager.block_ids("r"))  # the manager's list grows with the request
    tokens += [10, 11]  # decode up to exactly 12 tokens: still 3 blocks
    assert manager.allocate_slots("r", tokens, 10, 1)
    assert manager.allocate_slots("r", tokens, 11, 1)
    assert manager.block_ids("r") == table
    tokens.append(12)  # token 12 starts block 4; the table only grows at the end
    assert manager.allocate_slots("r", tokens, 12, 1)
    assert manager.block_ids("r")[:3] == table and len(manager.block_ids("r")) == 4
    assert 0 not in manager.block_ids("r")
    assert manager.num_free_blocks == 5 and manager.usage == pytest.approx(4 / 9)
    manager.free("r")
    manager.free("r")  # second free and unknown ids are no-ops
    manager.free("never-seen")
    assert manager.block_ids("r") == [] and manager.num_free_blocks == 9


def test_allocate_fails_atomically_when_short():
    manager = make(num_blocks=5)  # 4 usable
    assert manager.allocate_slots("a", list(range(12)), 0, 12)
    before = (manager.num_free_blocks, manager.block_ids("a"), manager.block_pool.num_cached_blocks)
    assert not manager.allocate_slots("b", list(range(100, 108)), 0, 8)  # needs 2, 1 free
    assert not manager.allocate_slots("a", list(range(20)), 12, 8)  # a would need 2 more
    assert (manager.num_free_blocks, manager.block_ids("a"), manager.block_pool.num_cached_blocks) == before
    assert manager.block_ids("b") == [] and "b" not in manager.req_to_blocks


def test_shortfall_counts_hit_blocks_waiting_in_free_queue():
    manager = make(num_blocks=5)  # 4 usable
    prompt = list(range(9))
    prefill(manager, "a", prompt)  # blocks for tokens 0-3, 4-7 cached; 3 blocks in all
    manager.free("a")
    assert manager.num_free_blocks == 4
    longer = prompt[:8] + list(range(50, 59))  # 17 tokens: 5 blocks, 2 of them hits
    hits, num_computed = manager.get_computed_blocks(longer)
    assert num_computed == 8
    # 3 fresh blocks are needed; 4 are free but 2 of those are the hits themselves.
    assert not manager.allocate_slots("b", longer, num_computed, 9, hits)
    assert [block.ref_cnt for block in hits] == [0, 0]
    assert all(manager.block_pool.get_cached_block(block.block_hash) is block for block in hits)
    assert manager.num_free_blocks == 4 and manager.block_ids("b") == []


def test_prefix_hit_shares_blocks_and_counts_hits():
    manager = make(num_blocks=10)
    prompt = list(range(10))
    assert prefill(manager, "a", prompt) == 0
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)
    other = prompt[:8] + [77, 78, 79]  # shares the first two full blocks
    blocks, num_computed = manager.get_computed_blocks(other)
    assert [b.block_id for b in blocks] == manager.block_ids("a")[:2] and num_computed == 8
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (21, 8)
    assert manager.hit_rate == pytest.approx(8 / 21)
    assert manager.allocate_slots("b", other, num_computed, 3, blocks)
    assert manager.block_ids("b")[:2] == manager.block_ids("a")[:2]
    assert [b.ref_cnt for b in blocks] == [2, 2]
    assert manager.num_free_blocks == 9 - 3 - 1  # b took one fresh block only
    manager.free("a")
    assert [b.ref_cnt for b in blocks] == [1, 1]  # still held by b
    assert manager.num_free_blocks == 9 - 3
    manager.free("b")
    assert manager.num_free_blocks == 9 and manager.usage == 0.0


def test_hit_leaves_at_least_one_token_to_compute():
    manager = make(num_blocks=10)
    prompt = list(range(8))  # exactly two full blocks
    prefill(manager, "a", prompt)
    blocks, num_computed = manager.get_computed_blocks(prompt)
    assert len(blocks) == 1 and num_computed == 4
    assert manager.get_computed_blocks(prompt + [8])[1] == 8
    assert manager.get_computed_blocks([]) == ([], 0)


def test_freed_blocks_hit_again_unless_evicted():
    manager = make(num_blocks=6)  # 5 usable
    prompt = list(range(13))  # blocks 0-2 full and cached, block 3 partial
    prefill(manager, "a", prompt)
    manager.free("a")
    assert manager.get_computed_blocks(prompt)[1] == 12
    # Light pressure: 3 fresh blocks evict the never-used block, then a's last blocks first.
    assert manager.allocate_slots("x", list(range(100, 112)), 0, 12)
    assert manager.get_computed_blocks(prompt)[1] == 8  # longest prefix survives
    manager.free("x")
    # Heavy pressure: every block taken, every hash evicted.
    assert manager.allocate_slots("y", list(range(200, 220)), 0, 20)
    manager.free("y")
    assert manager.get_computed_blocks(prompt) == ([], 0)


def test_decoded_tokens_are_cached_too():
    manager = make(num_blocks=10)
    tokens = list(range(6))
    prefill(manager, "a", tokens)
    for next_token in (6, 7, 8):  # decode; tokens 4-7 fill block 1
        tokens.append(next_token)
        assert manager.allocate_slots("a", tokens, len(tokens) - 1, 1)
    blocks, num_computed = manager.get_computed_blocks(tokens + [99])
    assert num_computed == 8 and [b.block_id for b in blocks] == manager.block_ids("a")[:2]


def test_chunked_prefill_caches_only_computed_blocks():
    manager = make(num_blocks=10)
    prompt = list(range(12))
    assert manager.allocate_slots("a", prompt, 0, 5)  # first chunk: tokens 0-4
    assert manager.get_computed_blocks(prompt)[1] == 4  # block 1 is not full yet
    assert manager.allocate_slots("a", prompt, 5, 7)
    assert manager.get_computed_blocks(prompt + [12])[1] == 12


def test_lookahead_slots_are_allocated_but_not_cached():
    """A draft chain's lookahead positions get blocks, but a block they fill holds no KV of the model's yet: a chunk
    ending 3 tokens before a block's end, with 3 of lookahead, leaves that block out of the prefix cache."""
    manager = make(num_blocks=10)
    prompt = list(range(12))
    assert manager.allocate_slots("a", prompt, 0, 5, (), 3)  # tokens 0-4, lookahead 5-7
    assert len(manager.block_ids("a")) == 2
    assert manager.get_computed_blocks(prompt)[1] == 4  # (block 1, tokens 4-7, is not computed)
    assert manager.allocate_slots("a", prompt, 5, 3, (), 3)  # tokens 5-7: now it is
    assert len(manager.block_ids("a")) == 3
    assert manager.get_computed_blocks(prompt)[1] == 8


def test_prefix_caching_off_never_hits():
    manager = make(num_blocks=10, enable_prefix_caching=False)
    prompt = list(range(10))
    prefill(manager, "a", prompt)
    manager.free("a")
    prefill(manager, "b", prompt)
    assert manager.get_computed_blocks(prompt) == ([], 0)
    assert manager.hit_rate == 0.0 and manager.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    manager = make(num_blocks=10)
    prompt = list(range(9))
    prefill(manager, "a", prompt)
    assert not manager.reset_prefix_cache()
    manager.free("a")
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(prompt) == ([], 0)


def test_hit_blocks_only_on_first_allocation():
    manager = make(num_blocks=10)
    prefill(manager, "a", list(range(9)))
    blocks, _ = manager.get_computed_blocks(list(range(9)))
    with pytest.raises(ValueError):
        manager.allocate_slots("a", list(range(9)), 8, 1, blocks)


@pytest.mark.parametrize("seed", range(5))
def test_random_allocate_free_against_model(seed: int):
    """Random prefills (with shared prefixes), decodes and frees against a plain model."""
    rng = random.Random(seed)
    manager = make(num_blocks=12)
    usable = 11
    prefixes = [[rng.randrange(8) for _ in range(rng.randrange(13))] for _ in range(3)]
    live: dict[str, list[int]] = {}  # request id -> tokens whose KV is allocated
    written: dict[int, tuple[int, ...]] = {}  # block id -> all tokens up to its end, as written

    def held_blocks() -> set[int]:
        return {block_id for rid in live for block_id in manager.block_ids(rid)}

    def record(rid: str) -> None:
        tokens = live[rid]
        for i, block_id in enumerate(manager.block_ids(rid)):
            written[block_id] = tuple(tokens[: (i + 1) * BLOCK_SIZE])

    for step in range(1500):
        free_before = manager.num_free_blocks
        op = rng.random()
        if op < 0.35 or not live:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(8) for _ in range(1 + rng.randrange(9))]
            hits, num_computed = manager.get_computed_blocks(prompt)
            assert num_computed == len(hits) * BLOCK_SIZE < len(prompt)
            for i, block in enumerate(hits):  # a hit holds exactly this prompt's prefix
                assert written[block.block_id] == tuple(prompt[: (i + 1) * BLOCK_SIZE])
            num_fresh = -(-len(prompt) // BLOCK_SIZE) - len(hits)
            num_hits_free = len({b.block_id for b in hits} - held_blocks())
            expect_ok = num_fresh <= free_before - num_hits_free
            ok = manager.allocate_slots(rid, prompt, num_computed, len(prompt) - num_computed, hits)
            assert ok == expect_ok
            if ok:
                live[rid] = prompt
                record(rid)
                assert manager.num_free_blocks == free_before - num_fresh - num_hits_free
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randrange(8)]
            table = manager.block_ids(rid)
            expect_ok = len(tokens) <= len(table) * BLOCK_SIZE or free_before >= 1
            assert manager.allocate_slots(rid, tokens, len(tokens) - 1, 1) == expect_ok
            if expect_ok:
                live[rid] = tokens
                record(rid)
            else:
                assert manager.block_ids(rid) == table
        else:
            rid = rng.choice(sorted(live))
            manager.free(rid)
            del live[rid]
        # Invariants against the model.
        held = held_blocks()
        assert manager.num_free_blocks == usable - len(held)
        for rid, tokens in live.items():
            table = manager.block_ids(rid)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE) and len(set(table)) == len(table)
            assert 0 not in table
        for block_id in held:
            owners = sum(block_id in manager.block_ids(rid) for rid in live)
            assert manager.block_pool.blocks[block_id].ref_cnt == owners

    for rid in list(live):
        manager.free(rid)
    assert manager.num_free_blocks == usable and manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_uncache_hides_blocks_from_prefix_lookups():
    """After a failed forward pass the request's hashed blocks must not be hit by anyone."""
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 14))  # 3 full blocks + 1 token
    assert manager.allocate_slots("a", tokens, 0, len(tokens))
    assert manager.get_computed_blocks(tokens)[1] == 12
    manager.uncache("a")
    assert manager.get_computed_blocks(tokens) == ([], 0)
    manager.free("a")
    assert manager.num_free_blocks == 15


def test_a_sliding_window_frees_the_blocks_behind_it():
    """Window 6, blocks of 4: the next token at position p sees keys p - 5 .. p, so the blocks wholly before p - 5
    go back as a request decodes (table entries: the null block), and the request never holds more than the
    window's blocks and the one it writes; free returns the rest, and every block comes back."""
    manager = KVCacheManager(12, BLOCK_SIZE, True, sliding_window=6)
    tokens = list(range(10))
    assert manager.allocate_slots("r", tokens, 0, 10)  # the first step's queries see from key 0
    assert manager.block_ids("r") == [1, 2, 3] and manager.num_free_blocks == 8
    held = []
    for p in range(10, 40):  # decode: position p's step
        tokens.append(p)
        assert manager.allocate_slots("r", tokens, p, 1)
        behind = (p - 6 + 1) // BLOCK_SIZE  # blocks wholly before key p - 5
        table = manager.block_ids("r")
        assert table[:behind] == [0] * behind and 0 not in table[behind:]
        held.append(len(table) - behind)
    assert max(held) == 3  # (6 keys and the new one span at most 3 blocks of 4)
    assert manager.num_free_blocks == 11 - held[-1]
    manager.free("r")
    assert manager.num_free_blocks == 11 and manager.req_to_freed == {}


def test_blocks_freed_behind_a_window_stay_findable_until_reused():
    """A second request with the same 12-token prefix hits the first's blocks, freed behind its window but still
    cached; shared blocks go back once each holder is done with them."""
    manager = KVCacheManager(12, BLOCK_SIZE, True, sliding_window=4)
    first = list(range(16))
    assert prefill(manager, "a", first) == 0  # (its first query sees key 0: nothing is behind yet)
    a_blocks = list(manager.block_ids("a"))
    assert manager.allocate_slots("a", first + [16], 16, 1)  # position 16 sees keys 13..16: blocks 0-2 go
    assert manager.block_ids("a")[:3] == [0, 0, 0] and manager.num_free_blocks == 11 - 2
    assert prefill(manager, "b", first[:12] + [99, 98]) == 12  # a's freed blocks 0-2, still cached
    # b's first new query (position 12) sees keys 9..12: its blocks 0-1 go back at once, block 2 it keeps
    assert manager.block_ids("b")[:3] == [0, 0, a_blocks[2]]
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 11
