"""How the split-KV decode kernel's last split to finish merges its kv head's partials into the output (each
partial's unnormalised accumulator, running max and sum, in log2 units)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_rows(
    part_acc_ptr,
    part_max_ptr,
    first,
    num_splits,
    c,
    offs_h,
    m_max,
    offs_d,
    Q_PER_KV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Splits c .. c + CHUNK of `_merge_splits`' accumulators, each rescaled by its 2^(max_s - max), summed: one
    [heads, head_dim] load a split, one after another in the code, none hanging on another's result. The split axis
    is no tensor axis, so each thread sums its own columns (as one [CHUNK, heads, head_dim] load summed over its
    first axis, Triton lays the sum out across threads: warp shuffles and shared-memory round trips)."""
    QP: tl.constexpr = triton.next_power_of_2(Q_PER_KV)
    acc = tl.zeros([QP, HEAD_DIM_P], tl.float32)
    for j in tl.static_range(CHUNK):
        split = tl.full([QP], c + j, tl.int32)
        ok = (offs_h < Q_PER_KV) & (split < num_splits)
        part = first + offs_h * NUM_SPLITS + split
        m_s = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        a_s = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
            mask=ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.where(m_s > float("-inf"), tl.math.exp2(m_s - m_max), 0.0)[:, None] * a_s
    return acc


@triton.jit
def _merge_splits(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    first,
    num_splits,
    o_offs,
    stride_o_h,
    Q_PER_KV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The outputs of one kv head's Q_PER_KV query heads from their first `num_splits` partials (head i's at
    first + i * NUM_SPLITS, + 1, ...), each rescaled by 2^(max_s - max) and the sum normalised. First every head's
    maxima and sums (small), then the accumulators of every head CHUNK splits a step (`_merge_rows`), a step past
    the splits used skipped."""
    QP: tl.constexpr = triton.next_power_of_2(Q_PER_KV)
    SPLITS_P: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
    offs_h = tl.arange(0, QP)
    offs_s = tl.arange(0, SPLITS_P)
    ok = (offs_h < Q_PER_KV)[:, None] & (offs_s < num_splits)[None, :]
    part = first + offs_h[:, None] * NUM_SPLITS + offs_s[None, :]  # [QP, SPLITS_P]
    m = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_sum_ptr + part, mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a head no split has seen a key for
    total = tl.sum(tl.where(m > float("-inf"), tl.math.exp2(m - m_max[:, None]), 0.0) * l_s, 1)
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    offs_d = tl.arange(0, HEAD_DIM_P)
    acc = tl.zeros([QP, HEAD_DIM_P], tl.float32)
    for c in tl.static_range(0, NUM_SPLITS, CHUNK):
        if c < num_splits:
            acc += _merge_rows(
                part_acc_ptr,
                part_max_ptr,
                first,
                num_splits,
                c,
                offs_h,
                m_max,
                offs_d,
                Q_PER_KV,
                NUM_SPLITS,
                HEAD_DIM_P,
                CHUNK,
            )
    o_ptrs = out_ptr + o_offs + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(
        o_ptrs,
        (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
        mask=(offs_h < Q_PER_KV)[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


def merge_chunk(q_per_kv: int, head_dim_p: int, num_splits: int, num_warps: int) -> int:
    """Splits a step of `_merge_splits`: its accumulators' loads about 64 registers a thread (a power of two, at
    most the split count's)."""
    per_split = triton.next_power_of_2(q_per_kv) * head_dim_p
    chunk = max(1, 64 * 32 * num_warps // per_split)
    return min(1 << (chunk.bit_length() - 1), triton.next_power_of_2(num_splits))


@triton.jit
def _merge_head(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    part,
    num_splits,
    o_offs,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """One head's output from its first `num_splits` partials (at part, part + 1, ...), all loaded at once: the
    merge of the one-split builds, where it never runs (`_decode_split_kernel`'s note)."""
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    ok = offs_s < num_splits
    m = tl.load(part_max_ptr + part + offs_s, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_sum_ptr + part + offs_s, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(
        part_acc_ptr + (part + offs_s)[:, None] * HEAD_DIM_P + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
        cache_modifier=".cg",
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + o_offs + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
