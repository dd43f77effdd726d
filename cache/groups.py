"""The layers' KV cache groups: which layers share a block table, and which cache tensor each layer's pages are in.

A model whose layers all attend alike (every one full, or every one sliding with the same window) has one group: a
request has one block table, and each layer a cache tensor of its own. A model that mixes them (Gemma 2 alternates
full and 4k-window layers, Gemma 3 has five 1k-window layers to each full one) needs the sliding layers' blocks
freed as their window moves while the full layers keep theirs, so each kind gets block tables of its own:

    gemma-3-1b, 26 layers, 4 full (5, 11, 17, 23), 22 sliding (window 512), groups of 4 layers:
    group 0  full     layers  5 11 17 23       slots 0 1 2 3
    group 1  sliding  layers  0  1  2  3       slots 0 1 2 3
    ...
    group 6  sliding  layers 24 25             slots 0 1

Every group has as many layers as the smallest kind (a last group of a kind may have fewer), and all groups take
their blocks from one pool: block b of the cache is, in slot tensor s, the page of the layer in slot s of
whichever group holds b. So one pool sizes them all, and a request takes from it what each group needs: all of
its context in the full group, a window's worth in each sliding one (about a sixth of the KV in all, for Gemma 3
at long context).

Layers whose pages differ in size (Gemma 4: a sliding layer's token is 16 KV heads of 256, a full layer's 4 of 512)
are kinds of their own. A block's page in a slot is as big as the largest kind's (R elements a token); a kind whose
token is R / k elements packs k layers in a slot, each in its own k-th of the page, so no block holds a gap:

    gemma-4-31b, 50 sliding layers of 4096 a token, 10 full of 2048 (k = 2), 5 slots:
    group 0  full     layers  5 11 17 23 29 | 35 41 47 53 59    slots 0-4, part 0 of the page | part 1
    group 1  sliding  layers  0  1  2  3  4                     slots 0-4
    ...
    group 10 sliding  layers 54 55 56 57 58                     slots 0-4

A packed layer's cache tensor is its slot's memory seen as k times as many pages, starting j pages in (its part):
its page k * b is part j of block b. Its group's block tables hold k * b for block b (`pages_per_block`), so the
attention kernels address it as any other cache (sizing.py `allocate_kv_caches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # each group's sliding window (0: full attention)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's slot: the cache tensor its pages are in
    num_slots: int  # cache tensors: a block holds a page of each
    pages_per_block: tuple[int, ...] = ()  # each group's layers to a slot's page (k; empty: 1 each)
    layer_part: tuple[int, ...] = ()  # each layer's part of its slot's page (j < k; empty: 0 each)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def group_layers(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.layer_group) if g == group]

    def group_pages(self, group: int) -> int:
        """How many of the group's layers share a slot's page (k)."""
        return self.pages_per_block[group] if self.pages_per_block else 1

    def part_of(self, layer: int) -> int:
        """The layer's part of its slot's page (j)."""
        return self.layer_part[layer] if self.layer_part else 0


def kv_groups(layer_windows: Sequence[int], layer_rows: Sequence[int] | None = None) -> KVGroups:
    """The groups of layers whose windows are `layer_windows` (0: full attention) and whose pages hold `layer_rows`
    elements a token (None: all alike), as the module says."""
    num_layers = len(layer_windows)
    rows = list(layer_rows) if layer_rows is not None else [1] * num_layers
    kinds = sorted(set(zip(layer_windows, rows)))
    if len(kinds) == 1:  # one group, a cache tensor a layer
        return KVGroups((kinds[0][0],), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    page = math.lcm(*rows)  # (Gemma 4's: the larger kind's)
    members = {
        kind: [layer for layer in range(num_layers) if (layer_windows[layer], rows[layer]) == kind] for kind in kinds
    }
    packing = {kind: page // kind[1] for kind in kinds}
    size = min(-(-len(layers) // packing[kind]) for kind, layers in members.items())  # slots
    windows, pages, layer_group, layer_slot = [], [], [0] * num_layers, [0] * num_layers
    layer_part = [0] * num_layers
    for kind in kinds:
        layers, k = members[kind], packing[kind]
        for start in range(0, len(layers), size * k):
            for i, layer in enumerate(layers[start : start + size * k]):
                layer_group[layer], layer_slot[layer], layer_part[layer] = len(windows), i % size, i // size
            windows.append(kind[0])
            pages.append(k)
    if pages == [1] * len(pages):
        return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size, tuple(pages), tuple(layer_part))
