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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # each group's sliding window (0: full attention)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's slot: the cache tensor its pages are in
    num_slots: int  # cache tensors: a block holds this many layers' pages

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def group_layers(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.layer_group) if g == group]


def kv_groups(layer_windows: Sequence[int]) -> KVGroups:
    """The groups of layers whose windows are `layer_windows` (0: full attention), as the module says."""
    num_layers = len(layer_windows)
    kinds = sorted(set(layer_windows))
    if len(kinds) == 1:  # one group, a cache tensor a layer
        return KVGroups((kinds[0],), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    members = {w: [layer for layer, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in members.values())
    windows, layer_group, layer_slot = [], [0] * num_layers, [0] * num_layers
    for w in kinds:
        layers = members[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
