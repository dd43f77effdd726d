"""The building blocks of Kiln's Triton attention kernels (`triton_attention`, `triton_decode`): one online-softmax
step over a tile of keys read through the block table, in its general form (masks, causal limit, 64-bit offsets) and
its lean one, and the loop over a range of keys.

Paged K/V addressing (row = num_kv_heads * head_dim elements)::

    position p of request s  ->  page = block_table[s, p // BLOCK_SIZE]
                                 slot = page * BLOCK_SIZE + p % BLOCK_SIZE
                                 K[p, h, :] = k_cache[slot * row + h * head_dim : ... + head_dim]

An FP8 cache (`--kv-cache-dtype fp8`) holds e4m3 values (scale 1.0): a tile is converted to q's dtype as it loads,
and `to_cache` rounds what the kernels write.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.backends.kernels.fp8_gemv import _round_e4m3

LOG2E = 1.4426950408889634


@triton.jit
def to_cache(x, cache_ptr):
    """x as the cache at cache_ptr holds it: for an FP8 cache, rounded to e4m3 (to nearest even, saturated; float32
    arithmetic, as Triton's interpreter converts wrongly), else as it is (the store converts)."""
    # (the else: a compile-time `if` followed by a second return compiles both, and their types differ)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return _round_e4m3(x.to(tl.float32), 1.0).to(tl.float8e4nv)
    else:
        return x


@triton.jit
def _tile_pages32(block_table_row_ptr, start_n, visible_end, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """The page of each key in [start_n, start_n + TILE_N) (0 past visible_end), as the table holds it (32-bit)."""
    offs_n = start_n + tl.arange(0, TILE_N)
    return tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=offs_n < visible_end, other=0)


@triton.jit
def _tile_pages(block_table_row_ptr, start_n, visible_end, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """`_tile_pages32` widened for 64-bit offsets."""
    return _tile_pages32(block_table_row_ptr, start_n, visible_end, BLOCK_SIZE, TILE_N).to(tl.int64)


@triton.jit
def _sink_start(sinks_ptr, head, row_ok):
    """The running max each row starts from with attention sinks: its head's sink (float32, natural-log units) in
    log2 units, as a key already seen with nothing to add (the caller starts the running sum at 1); -inf for rows
    that are padding."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # (log2 e)
    return tl.where(row_ok, sink, float("-inf"))


@triton.jit
def _tanh(x):
    """tanh from exp2 (the same in Triton's interpreter): 1 - 2 / (e^2x + 1), which saturates to +-1 at the ends."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # (2 log2 e)


@triton.jit
def _dot(a, b):
    """a @ b, accumulated in float32; float32 inputs at full float32 precision ("ieee"): Triton's default for them,
    TF32's 10-bit mantissa, moves a float32 model's log-probabilities ~1e-2 off its reference."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    page,
    kv_head,
    start_n,
    visible_end,
    causal_limit,
    offs_d,
    d_ok,
    qk_scale,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    """One online-softmax step over keys [start_n, start_n + TILE_N), on their pages (`_tile_pages`): row r may see
    key n when n < visible_end and n <= causal_limit[r] (and, with a WINDOW, n > causal_limit[r] - WINDOW). Scores
    are in log2 units (qk_scale includes log2 e); with a SOFTCAP (Gemma 2's, in log2 units too) each is
    SOFTCAP * tanh(score / SOFTCAP) first."""
    offs_n = start_n + tl.arange(0, TILE_N)
    n_ok = offs_n < visible_end
    slot = page * BLOCK_SIZE + offs_n % BLOCK_SIZE
    base = slot * ROW + kv_head * HEAD_DIM
    k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    s = _dot(q, k.to(q.dtype)) * qk_scale
    if SOFTCAP > 0:
        s = SOFTCAP * _tanh(s / SOFTCAP)
    allowed = n_ok[None, :] & (offs_n[None, :] <= causal_limit[:, None])
    if WINDOW > 0:
        allowed &= offs_n[None, :] > causal_limit[:, None] - WINDOW
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_range(
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
    causal_limit,
    offs_d,
    d_ok,
    qk_scale,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    """`_attend_tile` over keys [start, end) (within a WINDOW of each row's causal limit), tile by tile, each tile's
    pages loaded one iteration ahead (a value the loop carries). NOTE: loaded in the iteration that uses them, they
    would leave Triton's pipeliner a K/V address that hangs on a load of the same iteration, and it then keeps one
    K/V buffer whatever num_stages (`scripts/dev/kernel_resources.py`'s BUF column)."""
    page = _tile_pages(table_row, start, end, BLOCK_SIZE, TILE_N)
    for start_n in range(start, end, TILE_N):
        this_page = page
        page = _tile_pages(table_row, start_n + TILE_N, end, BLOCK_SIZE, TILE_N)
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            this_page,
            kv_head,
            start_n,
            end,
            causal_limit,
            offs_d,
            d_ok,
            qk_scale,
            ROW,
            HEAD_DIM,
            BLOCK_SIZE,
            TILE_N,
            WINDOW,
            SOFTCAP,
        )
    return m_i, l_i, acc


@triton.jit
def _attend_lean_tile(
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
    ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """`_attend_tile` with fewer instructions, for keys every row may see (a decode's, or a prefill block's below its
    first row): no causal limit, no mask on a full tile (MASKED: the last, partial one), 32-bit offsets from the
    head's own base pointers (the caller checks a layer's cache has fewer than 2**31 elements), head_dim a power of
    two. `page`: the tile's pages, 32-bit."""
    offs_n = start_n + tl.arange(0, TILE_N)
    n_ok = offs_n < visible_end
    base = (page * BLOCK_SIZE + offs_n % BLOCK_SIZE) * ROW
    if MASKED:
        k = tl.load(k_head_ptr + base[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
    else:
        k = tl.load(k_head_ptr + base[None, :] + offs_d[:, None])
    s = _dot(q, k.to(q.dtype)) * qk_scale
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    if MASKED:
        v = tl.load(v_head_ptr + base[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_head_ptr + base[:, None] + offs_d[None, :])
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i * alpha + tl.sum(p, 1), acc
