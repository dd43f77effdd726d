"""KV groups (which layers share block tables and slot tensors) and the hybrid manager over them: each group's
blocks from one pool, sliding groups' blocks behind the window freed, allocations all or nothing, prefix hits
per group, nothing leaked."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.cache import HybridKVCacheManager, KVCacheManager, KVCacheSpec, kv_groups, make_kv_cache_manager
from kiln.cache.sizing import allocate_kv_caches
from kiln.engine.models.source import resolve_model

BLOCK_SIZE = 4
WINDOW = 8
TINY = (WINDOW, WINDOW, 0)  # the tiny Gemma's layers: two sliding, one global


@pytest.mark.parametrize("preset", ["gemma-3-1b", "gemma-3-27b", "gemma-2-9b", "mistral-7b-v0.1", "llama-3.2-1b"])
def test_every_layer_has_one_slot_in_one_group_of_its_window(preset):
    config = resolve_model(preset).model_config
    windows = [config.window_of(layer) for layer in range(config.num_layers)]
    groups = kv_groups(windows)
    kinds = set(windows)
    smallest = min(windows.count(w) for w in kinds)
    assert groups.num_slots == (smallest if len(kinds) > 1 else config.num_layers)
    # as many groups as each kind's layers fill, each of its layers' window, no (group, slot) taken twice
    assert groups.num_groups == (sum(math.ceil(windows.count(w) / smallest) for w in kinds) if len(kinds) > 1 else 1)
    pairs = set(zip(groups.layer_group, groups.layer_slot))
    assert len(pairs) == config.num_layers and all(s < groups.num_slots for _, s in pairs)
    for layer, (g, _) in enumerate(zip(groups.layer_group, groups.layer_slot)):
        assert groups.windows[g] == windows[layer]


def test_the_slot_tensors_are_shared_by_a_layer_of_each_group():
    groups = kv_groups(TINY)
    spec = KVCacheSpec(3, 2, 8, BLOCK_SIZE, torch.float32, groups)
    caches = allocate_kv_caches(spec, 5, "cpu")
    assert groups.num_slots == 1 and len({t.data_ptr() for t in caches}) == 1 and len(caches) == 3
    assert spec.bytes_per_block == 2 * 1 * BLOCK_SIZE * 2 * 8 * 4  # a block: one layer's page in each group
    assert isinstance(make_kv_cache_manager(10, BLOCK_SIZE, True, kv_groups((0, 0))), KVCacheManager)


def make(num_blocks: int = 64) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, BLOCK_SIZE, True, kv_groups(TINY))


def held(manager: HybridKVCacheManager, request_id: str) -> list[int]:
    """Each group's blocks the request holds (not the null block its freed entries show)."""
    return [sum(1 for b in table if b) for table in manager.block_ids(request_id)]


def test_sliding_groups_hold_only_their_window():
    manager = make()
    tokens = list(range(40))
    blocks, computed = manager.get_computed_blocks(tokens)
    assert manager.allocate_slots("r", tokens, computed, 40, blocks)
    assert held(manager, "r") == [10, 10, 10]  # the prefill's own tokens see back to position 0
    for step in range(12):  # decode: the window moves, the sliding groups give its tail back
        tokens.append(100 + step)
        assert manager.allocate_slots("r", tokens, len(tokens) - 1, 1)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        behind = (len(tokens) - 1 - WINDOW + 1) // BLOCK_SIZE
        full, *sliding = held(manager, "r")
        assert full == num_blocks and sliding == [num_blocks - behind] * 2
        assert manager.num_free_blocks == 63 - full - sum(sliding)
    manager.free("r")
    assert manager.num_free_blocks == 63 and manager.usage == 0.0


def test_an_allocation_is_all_groups_or_none():
    manager = make(num_blocks=25)  # 24 usable: a 40-token prompt wants 10 in each of three groups
    tokens = list(range(40))
    assert not manager.allocate_slots("big", tokens, 0, 40)
    assert manager.num_free_blocks == 24 and manager.block_ids("big") == [[], [], []]
    assert manager.allocate_slots("small", tokens[:28], 0, 28)  # 7 a group
    assert manager.num_free_blocks == 3
    manager.free("small")
    assert manager.num_free_blocks == 24


def test_a_prefix_hit_is_what_every_group_has_and_groups_never_share_blocks():
    manager = make()
    first = list(range(30))
    blocks, computed = manager.get_computed_blocks(first)
    assert manager.allocate_slots("a", first, computed, len(first), blocks)
    first.append(7)
    assert manager.allocate_slots("a", first, 30, 1)  # (the sliding groups free their first blocks: still cached)
    manager.free("a")
    second = first[:24] + [500, 501, 502]
    hits, computed = manager.get_computed_blocks(second)
    # 6 blocks; a sliding group's hit is the blocks its next token's window covers, the null block before them
    behind = (computed - WINDOW + 1) // BLOCK_SIZE
    assert computed == 24 and [len(h) for h in hits] == [6, 6, 6] and behind == 4
    assert all(b.block_id == 0 for h in hits[1:] for b in h[:behind]) and all(b.block_id for b in hits[0])
    ids = [block.block_id for group in hits for block in group if block.block_id]
    assert len(set(ids)) == len(ids) == 10  # the same tokens, another group's KV: other blocks
    assert manager.allocate_slots("b", second, computed, len(second) - computed, hits)
    assert [table[:6] for table in manager.block_ids("b")] == [[b.block_id for b in h] for h in hits]
    manager.free("b")
    assert manager.num_free_blocks == 63
    # blocks before a sliding group's window are not needed: gone, the hit is the same
    a_sliding = manager.managers[1].lookup(second)
    manager.block_pool.uncache(a_sliding[: behind - 1])
    assert manager.get_computed_blocks(second)[1] == 24
    # one inside it is: the hit is then the longest prefix whose window that group still holds whole
    manager.block_pool.uncache(a_sliding[5:6])
    hits, computed = manager.get_computed_blocks(second)
    assert computed == 20 and [b.block_id for b in hits[1]] == [0, 0, 0] + [b.block_id for b in a_sliding[3:5]]
    assert manager.prefix_cache_hits == 24 + 24 + 20 and manager.prefix_cache_queries == 30 + 3 * len(second)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("windows", [TINY, (6, 0, 10, 0)], ids=["aligned", "unaligned"])
def test_decode_steps_that_skip_the_groups_change_what_the_groups_would(windows, prefix_caching):
    """The hybrid manager answers most decode steps without asking its groups (no block to take, hash or free):
    three requests of different prompt lengths, decoded token by token past several windows and blocks, give every
    group's tables, the pool's free blocks and cached hashes exactly those of a manager that asks every group
    every step."""
    fast = HybridKVCacheManager(256, BLOCK_SIZE, prefix_caching, kv_groups(windows))
    slow = HybridKVCacheManager(256, BLOCK_SIZE, prefix_caching, kv_groups(windows))
    slow._quiet_limits = lambda request_id: (-1, -1)  # every step the whole path
    prompts = {"a": list(range(1, 6)), "b": list(range(10, 23)), "c": [7] * 9}
    for manager in (fast, slow):
        for rid, prompt in prompts.items():
            assert manager.allocate_slots(rid, prompt, 0, len(prompt))
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for step in range(30):
        for rid, t in tokens.items():
            t.append(100 + step)
            for manager in (fast, slow):
                assert manager.allocate_slots(rid, t, len(t) - 1, 1)
            assert fast.block_ids(rid) == slow.block_ids(rid), (step, rid)
        assert fast.num_free_blocks == slow.num_free_blocks, step
        assert fast.block_pool.num_cached_blocks == slow.block_pool.num_cached_blocks, step
    held_if_nothing_freed = len(fast.managers) * sum(-(-len(t) // BLOCK_SIZE) for t in tokens.values())
    assert fast.num_free_blocks > 256 - 1 - held_if_nothing_freed  # the windows' blocks were freed
    for manager in (fast, slow):
        for rid in tokens:
            manager.free(rid)
        assert manager.num_free_blocks == 255


def test_a_hit_in_one_group_survives_another_groups_fresh_blocks():
    """The sliding groups' first blocks, freed as the window moved, sit at the free queue's head, whence the full
    group takes its fresh blocks: every group's hits are taken before any group's fresh blocks, so none is evicted."""
    manager = make(num_blocks=16)  # 15 usable
    first = list(range(16))
    assert manager.allocate_slots("a", first, 0, 16)  # 4 blocks a group
    for token in range(4):  # to 20 tokens: a fifth block each, the sliding groups' first three freed
        first.append(100 + token)
        assert manager.allocate_slots("a", first, len(first) - 1, 1)
    manager.free("a")
    second = first[:8] + [500, 501, 502, 503, 504]
    hits, computed = manager.get_computed_blocks(second)
    assert computed == 8 and all(len(h) == 2 for h in hits)
    assert manager.allocate_slots("b", second, computed, len(second) - computed, hits)
    assert [table[:2] for table in manager.block_ids("b")] == [[b.block_id for b in h] for h in hits]
    manager.free("b")
    assert manager.num_free_blocks == 15


# Gemma 4's layouts: 31B's sliding layers (16 KV heads of 256) with full ones of half their page (4 of 512), E4B's
# sliding layers (2 of 256) with full ones of twice theirs (2 of 512)
GEMMA4_31B = [(0, 4 * 512) if (i + 1) % 6 == 0 else (1024, 16 * 256) for i in range(60)]
GEMMA4_E4B = [(0, 2 * 512) if i % 6 == 5 else (512, 2 * 256) for i in range(24)]  # (its 24 layers with KV)


@pytest.mark.parametrize("layout", [GEMMA4_31B, GEMMA4_E4B], ids=["31b", "e4b"])
def test_layers_of_smaller_pages_share_a_slots_page(layout):
    """A kind whose page is 1/k of the largest packs k layers into a slot's page: every (group, slot, part) holds one
    layer, and a block is the same bytes in every group (no gap)."""
    windows, rows = zip(*layout)
    groups = kv_groups(windows, rows)
    page = max(rows)
    for g in range(groups.num_groups):
        layers = groups.group_layers(g)
        k = groups.group_pages(g)
        assert k == page // rows[layers[0]] and all(groups.windows[g] == windows[layer] for layer in layers)
        assert len(layers) <= k * groups.num_slots
    places = {(groups.layer_group[i], groups.layer_slot[i], groups.part_of(i)) for i in range(len(layout))}
    assert len(places) == len(layout)
    full = [g for g in range(groups.num_groups) if groups.windows[g] == 0]
    if layout is GEMMA4_31B:  # 10 full layers in 5 slots, two to a page; 50 sliding layers, 10 groups of 5
        assert groups.num_slots == 5 and len(full) == 1 and groups.group_pages(full[0]) == 2
        assert groups.num_groups == 11
    else:  # 4 full layers in 4 slots; 20 sliding layers, two to a page: 3 groups of 8 (the last of 4)
        assert groups.num_slots == 4 and len(full) == 1 and groups.group_pages(full[0]) == 1
        assert groups.num_groups == 4


@pytest.mark.parametrize("sliding_row", [8, 2], ids=["smaller-full-pages", "smaller-sliding-pages"])
def test_pages_of_different_sizes_never_overlap(sliding_row):
    """Blocks handed to groups at random: each layer writes its own value into its K and V pages of each block its
    group holds (through its cache tensor, at its table's index k * b), and every page reads back its own value."""
    shapes = [(sliding_row // 2, 2)] * 4 + [(2, 2)] * 2  # four sliding layers, two full ones of 2 x 2 a token
    windows = [WINDOW] * 4 + [0] * 2
    groups = kv_groups(windows, [h * d for h, d in shapes])
    spec = KVCacheSpec(6, *shapes[0], BLOCK_SIZE, torch.float32, groups, tuple(shapes))
    num_blocks = 12
    caches = allocate_kv_caches(spec, num_blocks, "cpu")
    assert spec.bytes_per_block == 2 * groups.num_slots * BLOCK_SIZE * max(4, sliding_row) * 4
    owner = torch.randint(0, groups.num_groups, (num_blocks,), generator=torch.Generator().manual_seed(0)).tolist()

    def pages(layer: int):
        k = groups.group_pages(groups.layer_group[layer])
        return [(b, k * b) for b in range(1, num_blocks) if owner[b] == groups.layer_group[layer]]

    for layer, cache in enumerate(caches):
        assert cache.shape == spec.shape(num_blocks, layer) and cache.is_contiguous()
        for b, index in pages(layer):
            cache[0, index] = 1000 * layer + b
            cache[1, index] = -1000 * layer - b
    for layer, cache in enumerate(caches):
        for b, index in pages(layer):
            assert (cache[0, index] == 1000 * layer + b).all() and (cache[1, index] == -1000 * layer - b).all()


def test_a_packed_groups_tables_hold_each_blocks_first_page():
    groups = kv_groups([WINDOW] * 4 + [0] * 2, [4] * 4 + [8] * 2)  # the sliding layers two to a page
    manager = HybridKVCacheManager(32, BLOCK_SIZE, True, groups)
    tokens = list(range(20))
    assert manager.allocate_slots("r", tokens, 0, 20)
    sliding = [g for g in range(groups.num_groups) if groups.windows[g]]
    for g, table in enumerate(manager.block_ids("r")):
        k = groups.group_pages(g)
        assert k == (2 if g in sliding else 1) and all(page % k == 0 for page in table)
        pool_ids = [block.block_id for block in manager.managers[g].req_to_blocks["r"]]
        assert table == [k * b for b in pool_ids]
    manager.free("r")
    assert manager.num_free_blocks == 31
