"""Tensor-parallel collectives as registered custom ops: `kiln::all_reduce_` (in place) and `kiln::all_gather`.

Like `kiln::unified_attention`, each is opaque to Dynamo (a fake implementation gives its output's
shape), so the traced model holds one node per collective. Unlike attention they are not split
points: they stay inside the compute pieces Inductor compiles (as extern calls), and on the GPU they
are recorded inside the CUDA graphs with the rest of the piece.

Both run over the default process group: the tensor-parallel group is the whole world (one engine's
ranks). The all-reduce sums in place (the row-parallel matmul's output is its own to overwrite; a
functional op would clone it first, one more copy kernel a layer); the all-gather returns a new tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.library.custom_op("kiln::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor) -> None:
    """`x` becomes its sum over the ranks (row-parallel linears, the vocab-parallel embedding)."""
    dist.all_reduce(x)


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
