"""Tensor-parallel collectives as registered custom ops: `kiln::all_reduce` and `kiln::all_gather`.

Like `kiln::unified_attention`, each is opaque to Dynamo (a fake implementation gives its output's
shape), so the traced model holds one node per collective. Unlike attention they are not split
points: they stay inside the compute pieces Inductor compiles (as extern calls), and on the GPU they
are recorded inside the CUDA graphs with the rest of the piece.

Both run over the default process group: the tensor-parallel group is the whole world (one engine's
ranks). They are functional (return a new tensor) so Inductor may plan their buffers like any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (row-parallel linears, the vocab-parallel embedding)."""
    out = x.clone()
    dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, rank 0 first (the vocab-parallel LM head)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


@all_gather.register_fake
def _(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)
