"""The split-KV (flash-decoding) kernel for decode-only batches, which writes the new tokens' K/V itself, and its
launcher (its split count and launch config: `decode_plan`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.attention.decode_merge import _merge_head, _merge_splits, merge_chunk
from kiln.backends.attention.decode_plan import MIN_SPLIT_TOKENS, UNSPLIT_TOKENS, decode_config
from kiln.backends.attention.forward_context import AttentionMetadata
from kiln.backends.attention.tiles import (
    LOG2E,
    _attend_lean_tile,
    _attend_range,
    _sink_start,
    _tile_pages32,
    to_cache,
)
from kiln.backends.kernels import pdl
from kiln.backends.kernels.arrivals import arrival_counts


@triton.jit
def _attend_decode_tile(
    q,
    m_i,
    l_i,
    acc,
    k_head_ptr,
    v_head_ptr,
    table_row,
    start_n,
    visible_end,
    offs_d,
    qk_scale,
    ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """`_attend_lean_tile` for a decode, loading its tile's pages (masked on the last, partial tile)."""
    if MASKED:
        page = _tile_pages32(table_row, start_n, visible_end, BLOCK_SIZE, TILE_N)
    else:
        page = tl.load(table_row + (start_n + tl.arange(0, TILE_N)) // BLOCK_SIZE)
    return _attend_lean_tile(
        q,
        m_i,
        l_i,
        acc,
        k_head_ptr,
        v_head_ptr,
        page,
        start_n,
        visible_end,
        offs_d,
        qk_scale,
        ROW,
        BLOCK_SIZE,
        TILE_N,
        MASKED,
    )


@triton.jit
def _decode_split_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    arrivals_ptr,
    q_ptr,
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_key,
    stride_value,
    stride_o_t,
    stride_o_h,
    stride_block_table,
    min_split_pages,
    unsplit_pages,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_PER_KV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    LEAN: tl.constexpr,
    USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,  # Gemma 2's score cap in log2 units (0: none); it takes the general loop, as a WINDOW does
    HAS_SINKS: tl.constexpr = False,  # gpt-oss: a logit a head (`sinks_ptr`, float32) in each row's denominator
):
    """Program (request, kv_head, split): one query token's GROUP heads over one contiguous run of
    pages. A request uses only as many of the NUM_SPLITS splits as give each at least `min_split_pages`
    pages, and one up to `unsplit_pages` (that program normalises and writes the output itself, no
    partials). With more, each writes its unnormalised partial with its running max and sum (log2
    units) and counts itself in `arrivals`; the last to arrive merges them (and resets the count). The
    last split's program first writes the token's own K/V (this kv head's) into its slot, the one place
    it is read. So a decode is one kernel: no K/V write before it, no reduction after it.

    HAS_SINKS: split 0 starts from its heads' sinks (`_sink_start`), the others from nothing, so the merge of the
    partials counts each sink once.

    LEAN: the keys in `_attend_decode_tile`s (full tiles unmasked, 32-bit offsets), where head_dim is a power of
    two and a layer's cache has fewer than 2**31 elements; else the general loop of `_attend_range`."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata is read before the PDL wait (`kiln.backends.kernels.pdl`): it was copied in before the
    # step's first kernel and no kernel writes it, so three dependent loads leave the chain that waits on q, k, v.
    seq_len = tl.load(seq_lens_ptr + req)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if USE_PDL:  # everything else it reads but the cache comes from the kernels before it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    first_page = 0
    if WINDOW > 0:  # a sliding layer's: the splits share the window's pages only
        first_page = tl.maximum(seq_len - WINDOW, 0) // BLOCK_SIZE
    num_pages = tl.cdiv(seq_len, BLOCK_SIZE) - first_page
    pages_per_split = tl.maximum(tl.cdiv(num_pages, NUM_SPLITS), min_split_pages)
    pages_per_split = tl.where(num_pages <= unsplit_pages, tl.maximum(num_pages, 1), pages_per_split)
    splits = tl.maximum(tl.cdiv(num_pages, pages_per_split), 1)
    if split < splits:
        start = (first_page + split * pages_per_split) * BLOCK_SIZE
        end = tl.minimum(start + pages_per_split * BLOCK_SIZE, seq_len)
        offs_m = tl.arange(0, GROUP)
        offs_d = tl.arange(0, HEAD_DIM_P)
        d_ok = offs_d < HEAD_DIM
        row_ok = offs_m < Q_PER_KV
        head = kv_head * Q_PER_KV + offs_m
        # q before the K/V write: its load then overlaps the write's instead of waiting behind the write's barrier
        q = tl.load(
            q_ptr + token * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if split == splits - 1:
            if slot >= 0:  # NOTE: as in the unified kernel's K/V write, a negative slot writes nowhere
                row = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d
                k_new = tl.load(key_ptr + token * stride_key + kv_head * HEAD_DIM + offs_d, mask=d_ok)
                v_new = tl.load(value_ptr + token * stride_value + kv_head * HEAD_DIM + offs_d, mask=d_ok)
                tl.store(k_cache_ptr + row, to_cache(k_new, k_cache_ptr), mask=d_ok)
                tl.store(v_cache_ptr + row, to_cache(v_new, v_cache_ptr), mask=d_ok)
            tl.debug_barrier()  # the whole program reads the slot after the threads that wrote it
        m_i = tl.full([GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP], tl.float32)
        if HAS_SINKS:
            m_i = tl.where(split == 0, _sink_start(sinks_ptr, head, row_ok), float("-inf"))
            l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
        acc = tl.zeros([GROUP, HEAD_DIM_P], tl.float32)
        table_row = block_table_ptr + req * stride_block_table
        if LEAN and WINDOW == 0 and SOFTCAP == 0:  # full tiles without masks, then the partial one
            k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
            v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
            full_end = start + (end - start) // TILE_N * TILE_N
            for start_n in range(start, full_end, TILE_N):
                m_i, l_i, acc = _attend_decode_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_head_ptr,
                    v_head_ptr,
                    table_row,
                    start_n,
                    end,
                    offs_d,
                    qk_scale,
                    NUM_KV_HEADS * HEAD_DIM,
                    BLOCK_SIZE,
                    TILE_N,
                    False,
                )
            if full_end < end:
                m_i, l_i, acc = _attend_decode_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_head_ptr,
                    v_head_ptr,
                    table_row,
                    full_end,
                    end,
                    offs_d,
                    qk_scale,
                    NUM_KV_HEADS * HEAD_DIM,
                    BLOCK_SIZE,
                    TILE_N,
                    True,
                )
        else:
            # a decode sees its whole context, or with a WINDOW the keys after seq_len - 1 - WINDOW
            limit = tl.full([GROUP], 2147483647, tl.int32) if WINDOW == 0 else tl.full([GROUP], seq_len - 1, tl.int32)
            m_i, l_i, acc = _attend_range(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                table_row,
                kv_head,
                start,
                end,
                limit,
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
        if splits == 1:
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_offs = token * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
            tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            part = (req * NUM_HEADS + head) * NUM_SPLITS + split  # [B, H, S] layout
            tl.store(part_max_ptr + part, m_i, mask=row_ok)
            tl.store(part_sum_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])
            # NOTE: every thread's stores before one thread's release of the count (the barrier orders them);
            # the last arrival's acquire then sees all partials (read past L1: .cg).
            tl.debug_barrier()
            arrivals = arrivals_ptr + req * NUM_KV_HEADS + kv_head
            if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == splits - 1:
                tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
                if NUM_SPLITS == 1:
                    # NOTE: never runs (one split writes its output itself), but ptxas allocates registers for it:
                    # the small per-head merge keeps the one-split builds (every batch from 64 up) at the register
                    # count they are fastest with, where `_merge_splits` would raise it.
                    SPLITS_P: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
                    for i in tl.static_range(Q_PER_KV):
                        h = kv_head * Q_PER_KV + i
                        _merge_head(
                            out_ptr,
                            part_acc_ptr,
                            part_max_ptr,
                            part_sum_ptr,
                            (req * NUM_HEADS + h) * NUM_SPLITS,
                            splits,
                            token * stride_o_t + h * stride_o_h,
                            HEAD_DIM,
                            HEAD_DIM_P,
                            SPLITS_P,
                        )
                else:
                    first = (req * NUM_HEADS + kv_head * Q_PER_KV) * NUM_SPLITS
                    _merge_splits(
                        out_ptr,
                        part_acc_ptr,
                        part_max_ptr,
                        part_sum_ptr,
                        first,
                        splits,
                        token * stride_o_t + kv_head * Q_PER_KV * stride_o_h,
                        stride_o_h,
                        Q_PER_KV,
                        NUM_SPLITS,
                        HEAD_DIM,
                        HEAD_DIM_P,
                        MERGE_CHUNK,
                    )


# Each decode's (request, kv head) counts its splits' arrivals (`kiln.backends.kernels.arrivals`), in one buffer per
# device big enough for any batch: 512 capture rows x 128 KV heads.
MAX_ARRIVAL_SLOTS = 512 * 128


def split_kv_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    min_split_tokens: int | None = None,
    config: tuple[int, int, int] | None = None,
    unsplit_tokens: int = UNSPLIT_TOKENS,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Decode-only batch (one query per request), flash-decoding style (with a `window`, over its last `window` keys
    only: the pages before it are not read; with a `softcap`, scores capped by softcap * tanh; with `sinks`, each
    head's sink in its denominator), in one kernel that also
    writes the new K/V (key/value [R, num_kv_heads, head_dim], each token's heads contiguous): up to `num_splits`
    partials a request (as many as have `min_split_tokens` each, by default MIN_SPLIT_TOKENS or the config's key
    tile, whichever is more; one up to `unsplit_tokens`), merged by the last split to finish. `config`: (keys per
    tile, warps, pipeline stages), by default `decode_config`'s (the benchmarks sweep it)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    q_per_kv = num_heads // num_kv_heads
    num_reqs = metadata.seq_lens.shape[0]
    head_dim_p = triton.next_power_of_2(head_dim)
    num_programs = num_reqs * num_kv_heads * num_splits
    tile_n, num_warps, num_stages = config or decode_config(num_programs, num_reqs, kv_cache.element_size(), head_dim)
    min_split_tokens = max(MIN_SPLIT_TOKENS, tile_n) if min_split_tokens is None else min_split_tokens
    lean = head_dim == head_dim_p and kv_cache[0].numel() < 2**31  # its offsets are 32-bit
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim and value.stride(2) == 1
    part_acc = torch.empty(num_reqs, num_heads, num_splits, head_dim_p, dtype=torch.float32, device=query.device)
    part_max = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    assert num_reqs * num_kv_heads <= MAX_ARRIVAL_SLOTS
    arrivals = arrival_counts(query.device, "decode", MAX_ARRIVAL_SLOTS)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        arrivals,
        query,
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        metadata.slot_mapping,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        sinks if sinks is not None else metadata.seq_lens,  # (a pointer the kernel does not read without sinks)
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        value.stride(0),
        out.stride(0),
        out.stride(1),
        metadata.block_table.stride(0),
        max(1, -(-min_split_tokens // block_size)),
        unsplit_tokens // block_size,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_PER_KV=q_per_kv,
        GROUP=max(16, triton.next_power_of_2(q_per_kv)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        MERGE_CHUNK=merge_chunk(q_per_kv, head_dim_p, num_splits, num_warps),
        LEAN=lean,
        WINDOW=window,
        SOFTCAP=softcap * LOG2E,
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_kwargs(query),
    )
