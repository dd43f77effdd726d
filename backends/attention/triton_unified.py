"""Paged attention in Triton for any batch: a KV-write kernel and one unified kernel for any mix of prefill chunks
and decodes (decode-only batches take `triton_decode`'s split-KV kernel instead).

Every kernel reads its per-step metadata from device tensors and launches a grid that depends only on
the (padded) token count, the request count and constants: no host sync, nothing data-dependent,
so the op can be captured in a CUDA graph. The K/V addressing: `tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.attention.forward_context import AttentionMetadata
from kiln.backends.attention.tiles import (
    LOG2E,
    _attend_lean_tile,
    _attend_range,
    _sink_start,
    _tile_pages32,
    to_cache,
)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    v_offset,
    stride_key,
    stride_value,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # NOTE: a negative slot means "write nowhere" (padding that has no scratch slot)
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + token * stride_key + offs, mask=mask)
        v = tl.load(value_ptr + token * stride_value + offs, mask=mask)
        tl.store(cache_ptr + slot * ROW + offs, to_cache(k, cache_ptr), mask=mask)
        tl.store(cache_ptr + v_offset + slot * ROW + offs, to_cache(v, cache_ptr), mask=mask)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [T, num_kv_heads, head_dim] with each token's heads contiguous."""
    num_tokens = slot_mapping.shape[0]
    row = kv_cache.shape[-1] * kv_cache.shape[-2]
    assert key.stride(1) == key.shape[2] and key.stride(2) == 1 and value.stride(1) == value.shape[2]
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        kv_cache[0].numel(),
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Request i owns query blocks [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): enough for its
    queries, disjoint and increasing, so a binary search over qsl finds the owner of `q_block`."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# NOTE: `num_reqs` changes with every batch; specialised (== 1, divisible by 16) it would make new variants to
# JIT-compile while serving, each a stall of a fraction of a second.
@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    qk_scale,
    num_reqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_block_table,
    NUM_KV_HEADS: tl.constexpr,
    Q_PER_KV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    LEAN: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,  # Gemma 2's score cap in log2 units (0: none; LEAN is off with one)
    HAS_SINKS: tl.constexpr = False,  # gpt-oss: a logit a head (`sinks_ptr`, float32) in each row's denominator
):
    """Program (q_block, kv_head): up to BLOCK_Q query tokens of one request x the GROUP query heads
    sharing kv_head, as BLOCK_Q * GROUP rows, so GQA reads each K/V tile once for the whole group. LEAN (head_dim a
    power of two, a layer's cache under 2**31 elements): the keys every row sees (below the block's first query
    token) in `_attend_lean_tile`s first, their pages an iteration ahead; the rest, masked, after. With a WINDOW
    (a sliding layer's) every key from the block's first row's window on, masked. With HAS_SINKS each row starts
    from its head's sink as a key already seen (running max the sink, sum 1, nothing accumulated)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q < q_len:
        offs_m = tl.arange(0, BLOCK_Q * GROUP)
        offs_d = tl.arange(0, HEAD_DIM_P)
        d_ok = offs_d < HEAD_DIM
        q_pos = local_block * BLOCK_Q + offs_m // GROUP
        head = kv_head * Q_PER_KV + offs_m % GROUP
        row_ok = (q_pos < q_len) & (offs_m % GROUP < Q_PER_KV)
        q_offs = (q_start + q_pos).to(tl.int64)[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len
        causal_limit = context_len + q_pos
        visible_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)

        m_i = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
        if HAS_SINKS:
            m_i = _sink_start(sinks_ptr, head, row_ok)
            l_i = tl.where(row_ok, 1.0, 0.0)
        acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM_P], tl.float32)
        table_row = block_table_ptr + req * stride_block_table
        masked_start = 0
        if WINDOW > 0:  # (rows' windows start at different keys: all masked, from the lowest any row sees)
            masked_start = tl.maximum(context_len + local_block * BLOCK_Q - WINDOW + 1, 0)
        elif LEAN:
            # NOTE: at least 0: a padded request (one token, seq_len 0) has context_len -1
            masked_start = tl.maximum(context_len + local_block * BLOCK_Q, 0) // TILE_N * TILE_N
            k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
            v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
            page = _tile_pages32(table_row, 0, masked_start, BLOCK_SIZE, TILE_N)
            for start_n in range(0, masked_start, TILE_N):
                this_page = page
                page = _tile_pages32(table_row, start_n + TILE_N, masked_start, BLOCK_SIZE, TILE_N)
                m_i, l_i, acc = _attend_lean_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_head_ptr,
                    v_head_ptr,
                    this_page,
                    start_n,
                    masked_start,
                    offs_d,
                    qk_scale,
                    NUM_KV_HEADS * HEAD_DIM,
                    BLOCK_SIZE,
                    TILE_N,
                    False,
                )
        m_i, l_i, acc = _attend_range(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            kv_head,
            masked_start,
            visible_end,
            causal_limit,
            offs_d,
            d_ok,
            qk_scale,
            NUM_KV_HEADS * HEAD_DIM,
            HEAD_DIM,
            BLOCK_SIZE,
            TILE_N,
            WINDOW,
            SOFTCAP,
        )
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + q_pos).to(tl.int64)[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def unified_attention(
    query,
    kv_cache,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Any batch (prefill chunks and decodes), from the cache (its new K/V already written); with a `window`, each
    query sees the keys after its position - window only; with a `softcap`, scores are softcap * tanh(s / softcap);
    with `sinks` ([num_heads] float32), each head's sink joins its rows' softmax denominators."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    q_per_kv = num_heads // num_kv_heads
    group = max(triton.next_power_of_2(q_per_kv), 1)
    block_m = 64 if metadata.max_query_len > 16 else 16
    block_q = max(block_m // group, 1)
    num_reqs = metadata.query_start_loc.shape[0] - 1
    grid = (query.shape[0] // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        sinks if sinks is not None else metadata.seq_lens,  # (a pointer the kernel does not read without sinks)
        scale * LOG2E,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        metadata.block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        Q_PER_KV=q_per_kv,
        GROUP=group,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_N=32,
        LEAN=head_dim == triton.next_power_of_2(head_dim) and kv_cache[0].numel() < 2**31 and not softcap,
        WINDOW=window,
        SOFTCAP=softcap * LOG2E,
        HAS_SINKS=sinks is not None,
        # heads of 512 (Gemma 4's global layers): three stages of K/V tiles beside the queries pass the 227 KiB of
        # shared memory a Hopper block may have
        num_stages=2 if head_dim > 256 else 3,
    )
