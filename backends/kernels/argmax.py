"""Greedy sampling's argmax over the vocabulary in one kernel, for the few rows of a small-batch step.

`torch.argmax` gives a row one thread block, so at batch 1 a 128k-wide row is one block's work, far slower than
the bandwidth allows; splitting it into chunk maxima and an argmax of those takes torch five kernels. Here a program
takes one chunk of one row and writes its (max, first index of the max); the last program of the row to finish (an
arrival count, as in the split-KV decode kernel) reduces the row's chunks. One launch, no host sync, and
CUDA-graph safe: the counts return to zero at the end of every kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels import pdl
from kiln.backends.kernels.arrivals import arrival_counts

CHUNK = 2048  # elements a program reads (4 KB of bf16 logits)
MAX_ROWS = 64  # rows the arrival counts cover; more rows take torch.argmax, whose one block a row then fills the GPU


@triton.jit(do_not_specialize=["V", "stride_x"])  # one compiled variant per dtype, whatever the vocabulary
def _argmax_kernel(
    out_ptr,
    x_ptr,
    part_max_ptr,
    part_idx_ptr,
    arrivals_ptr,
    V,
    stride_x,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNKS_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # everything it reads comes from the kernel before it (see kiln.backends.kernels.pdl)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    # NaN counts as the largest value, as torch.argmax has it
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, 0)
    first = tl.min(tl.where((x == best) & (offs < V), offs, V), 0)
    tl.store(part_max_ptr + row * CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * CHUNKS + chunk, first)
    # NOTE: the stores before the count's release (the barrier orders every thread's), the last arrival's acquire
    # then sees every chunk's (read past L1: .cg)
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
        tl.atomic_xchg(arrivals_ptr + row, 0, sem="relaxed", scope="gpu")
        offs_c = tl.arange(0, CHUNKS_P)
        ok = offs_c < CHUNKS
        maxima = tl.load(part_max_ptr + row * CHUNKS + offs_c, mask=ok, other=float("-inf"), cache_modifier=".cg")
        firsts = tl.load(part_idx_ptr + row * CHUNKS + offs_c, mask=ok, other=V, cache_modifier=".cg")
        top = tl.max(maxima, 0)
        index = tl.min(tl.where(ok & (maxima == top), firsts, V), 0)
        tl.store(out_ptr + row, tl.where(index == V, 0, index).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [B, V] tensor with B <= MAX_ROWS and unit stride along V: [B] int64, the first
    index on ties (NaN as the largest value), as torch gives."""
    rows, vocab = x.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1, (x.shape, x.stride())
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    arrivals = arrival_counts(x.device, "argmax", MAX_ROWS)
    chunks = triton.cdiv(vocab, CHUNK)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _argmax_kernel[(rows, chunks)](
        out,
        x,
        part_max,
        part_idx,
        arrivals,
        vocab,
        x.stride(0),
        CHUNK=CHUNK,
        CHUNKS=chunks,
        CHUNKS_P=triton.next_power_of_2(chunks),
        num_warps=4,
        **pdl.launch_kwargs(x),
    )
    return out
