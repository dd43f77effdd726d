"""KV cache layout and sizing: how many blocks fit in the memory left after profiling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.cache.groups import KVGroups

_GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache; found at run time from the model and ``block_size``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    groups: KVGroups | None = None  # several: the layers share slot tensors (groups.py); None: one group
    # each layer's (KV heads, head dim) where the layers differ (Gemma 4's full layers); empty: all of them
    # num_kv_heads x head_dim
    layer_shapes: tuple[tuple[int, int], ...] = ()

    @property
    def num_slots(self) -> int:
        """Cache tensors: one a layer, or one a slot of the groups (a block holds this many layers' pages)."""
        return self.groups.num_slots if self.groups is not None else self.num_layers

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.layer_shapes and len(self.layer_shapes) != self.num_layers:
            raise ValueError(f"KVCacheSpec: {len(self.layer_shapes)} layer shapes for {self.num_layers} layers")

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """The layer's (KV heads, head dim)."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    @property
    def page_row(self) -> int:
        """Elements a token takes in a slot's page, K or V: a layer's heads x dim, or with layers of several sizes their
        least common multiple (Gemma 4's: the largest), into which the smaller are packed (groups.py)."""
        if not self.layer_shapes:
            return self.num_kv_heads * self.head_dim
        return math.lcm(*(heads * dim for heads, dim in self.layer_shapes))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all slots, K and V together."""
        return 2 * self.num_slots * self.block_size * self.page_row * self.dtype.itemsize

    def shape(self, num_blocks: int, layer: int = 0) -> tuple[int, int, int, int, int]:
        """The layer's cache tensor shape: (K/V, page, slot in page, kv head, head dim); a page a block, or k of them
        where k layers share a block's page (groups.py)."""
        heads, dim = self.layer_shape(layer)
        return (2, self._pages(layer) * num_blocks, self.block_size, heads, dim)

    def _pages(self, layer: int) -> int:
        return self.groups.group_pages(self.groups.layer_group[layer]) if self.groups is not None else 1


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, extra_bytes_per_block: int = 0) -> int:
    """Whole blocks that fit in ``budget_bytes``; at least 2 (block 0 is reserved) or ValueError.
    ``extra_bytes_per_block``: another cache indexed by the same blocks (a speculative draft's layer)."""
    block_bytes = spec.bytes_per_block + extra_bytes_per_block
    num_blocks = max(budget_bytes, 0) // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes ({budget_bytes / _GIB:.3f} GiB) fits {num_blocks} "
            f"blocks of {block_bytes} bytes; at least 2 are needed (block 0 is reserved). "
            "Raise gpu_memory_utilization, or lower max_num_batched_tokens or block_size."
        )
    return num_blocks


def gpu_kv_budget_bytes(total_bytes: int, gpu_memory_utilization: float, peak_used_bytes: int) -> int:
    """Bytes left for the KV cache: ``total * utilization - peak used``.

    ``peak_used_bytes`` is everything else the engine holds at its peak: weights, the activation
    peak of the profiling forward, and captured CUDA graphs. Raises ValueError if nothing is left
    or ``gpu_memory_utilization`` is outside (0, 1].
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    allowed_bytes = int(total_bytes * gpu_memory_utilization)
    budget_bytes = allowed_bytes - peak_used_bytes
    if budget_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_memory_utilization} of "
            f"{total_bytes / _GIB:.2f} GiB is {allowed_bytes / _GIB:.2f} GiB, but weights, activations "
            f"and graphs peaked at {peak_used_bytes / _GIB:.2f} GiB. Raise gpu_memory_utilization "
            "or lower max_num_batched_tokens."
        )
    return budget_bytes


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
    """Each layer's ``spec.shape(num_blocks, layer)`` cache tensor, zeroed: its own, or a view of its slot's memory
    (shared by a layer of each group), from its part of the first page where layers share a slot's pages
    (groups.py).

    Zeroed so the reserved null block and never-written slots hold finite values: padded
    attention reads them under a mask, and NaN * 0 would still be NaN.
    """
    if spec.groups is None:
        return [torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
    page = spec.block_size * spec.page_row
    # NOTE: a page past the end where pages are shared: a layer of part j starts j of its pages in, and ends as far
    # past the slot's 2 x num_blocks pages
    spare = page if spec.groups.layer_part else 0
    slots = [torch.zeros(2 * num_blocks * page + spare, dtype=spec.dtype, device=device) for _ in range(spec.num_slots)]
    caches = []
    for layer, slot in enumerate(spec.groups.layer_slot):
        shape = spec.shape(num_blocks, layer)
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        offset = spec.groups.part_of(layer) * spec.block_size * shape[-2] * shape[-1]
        caches.append(slots[slot].as_strided(shape, strides, offset))
    return caches
