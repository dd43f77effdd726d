"""Arrival counts: the pattern by which the last program of a group finishes a kernel's work in the same launch.

Each program of a group (a decode's splits of one request and KV head, the argmax's chunks of one row) does its
part, then adds 1 to the group's count; the one that sees the count reach the group's size does the rest (merges
the partials) and resets the count to 0. So the counts are all zero between kernels and one buffer serves every
launch: no memset, no host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch

_COUNTS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counts(device: torch.device, kernel: str, size: int) -> torch.Tensor:
    """The zeroed int32 counts of `kernel` on `device` (`size` groups), made at its first call.

    NOTE: that first call must come before any CUDA-graph capture (the warm-up's): made inside one, the buffer
    would belong to the graph's memory pool."""
    key = (device, kernel)
    if key not in _COUNTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the {kernel} kernel's first call must come before any CUDA-graph capture")
        _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTS[key]
