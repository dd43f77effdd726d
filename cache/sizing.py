"""KV cache layout and sizing: how many blocks fit in the memory left after profiling."""

from __future__ import annotations

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

    @property
    def num_slots(self) -> int:
        """Cache tensors: one a layer, or one a slot of the groups (a block holds this many layers' pages)."""
        return self.groups.num_slots if self.groups is not None else self.num_layers

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all slots, K and V together."""
        return 2 * self.num_slots * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Per-layer cache tensor shape: (K/V, block, slot in block, kv head, head dim)."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """Whole blocks that fit in ``budget_bytes``; at least 2 (block 0 is reserved) or ValueError."""
    num_blocks = max(budget_bytes, 0) // spec.bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes ({budget_bytes / _GIB:.3f} GiB) fits {num_blocks} "
            f"blocks of {spec.bytes_per_block} bytes; at least 2 are needed (block 0 is reserved). "
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
    """Each layer's ``spec.shape(num_blocks)`` cache tensor, zeroed: its own, or its slot's (shared by a layer of
    each group).

    Zeroed so the reserved null block and never-written slots hold finite values: padded
    attention reads them under a mask, and NaN * 0 would still be NaN.
    """
    slots = [torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device) for _ in range(spec.num_slots)]
    if spec.groups is None:
        return slots
    return [slots[slot] for slot in spec.groups.layer_slot]
