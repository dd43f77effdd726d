"""The split-KV (flash-decoding) kernel for decode-only batches, which writes the new tokens' K/V itself, its
split count and launch config (fixed by the batch size, so graph-safe), and its launcher."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.backends.attention.decode_merge import DECODE_MERGE, _merge_head, _merge_splits, merge_constexprs
from kiln.backends.attention.forward_context import AttentionMetadata
from kiln.backends.attention.tiles import LOG2E, _attend_lean_tile, _attend_range, _tile_pages32
from kiln.backends.kernels import pdl
from kiln.backends.kernels.arrivals import arrival_counts


@triton.jit
def _attend_decode_tile(q, m_i, l_i, acc, k_head_ptr, v_head_ptr, table_row, start_n, visible_end, offs_d, qk_scale,
                        ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                        MASKED: tl.constexpr):  # fmt: skip
    """`_attend_lean_tile` for a decode, loading its tile's pages (masked on the last, partial tile)."""
    if MASKED:
        page = _tile_pages32(table_row, start_n, visible_end, BLOCK_SIZE, TILE_N)
    else:
        page = tl.load(table_row + (start_n + tl.arange(0, TILE_N)) // BLOCK_SIZE)
    return _attend_lean_tile(q, m_i, l_i, acc, k_head_ptr, v_head_ptr, page, start_n, visible_end, offs_d, qk_scale,
                             ROW, BLOCK_SIZE, TILE_N, MASKED)  # fmt: skip


# The timeline probe (`split_kv_decode(timeline=...)`, scripts/dev/decode_timeline.py): a row of TIMELINE_COLUMNS int64 a
# program, (global timer ns, SM cycle counter) at each point — 0 its start, 1 its metadata arrived, 2 past the PDL
# wait, 3 past the K/V write's barrier, 4 + i after key tile i of the lean loop (the first TIMELINE_TILES), then its
# end (before the partials' stores) — then, the last split to arrive only, the global timer once it has merged the
# splits (column TIMELINE_MERGED) — and the SM it ran on in the last column. Off (a constexpr), the kernel is the same.
TIMELINE_TILES = tl.constexpr(10)
TIMELINE_COLUMNS = tl.constexpr(32)
TIMELINE_MERGED = tl.constexpr(30)


@triton.jit
def _stamp(dep):
    """(%globaltimer, %clock64) once `dep` (an int32 scalar) has arrived: the timeline's probe (TIMELINE)."""
    t = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $1, 123456789; @p mov.u64 $0, %globaltimer; "
                                  "@!p mov.u64 $0, 0; }", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    c = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $1, 123456789; @p mov.u64 $0, %clock64; "
                                  "@!p mov.u64 $0, 0; }", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    return t, c


@triton.jit
def _record(timeline_ptr, row, point, dep):
    """`_stamp(dep)` into program `row`'s line of the timeline, at `point`."""
    t, c = _stamp(dep)
    tl.store(timeline_ptr + row * TIMELINE_COLUMNS + 2 * point, t)
    tl.store(timeline_ptr + row * TIMELINE_COLUMNS + 2 * point + 1, c)


@triton.jit
def _spin(cycles: tl.constexpr, dep):
    """`dep` (an int32 scalar) once the SM has counted `cycles` clocks after it arrived: the delay probe
    (KILN_DECODE_DELAY)."""
    return tl.inline_asm_elementwise(
        "{ .reg .u64 t0, t1; .reg .pred p; mov.u64 t0, %clock64; add.u64 t0, t0, $2; "
        "spin${:uid}: mov.u64 t1, %clock64; setp.lt.u64 p, t1, t0; @p bra spin${:uid}; mov.b32 $0, $1; }",
        "=r,r,l", [dep, tl.full((), cycles, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_split_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr,
    v_cache_ptr, slot_mapping_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, qk_scale, stride_q_t,
    stride_q_h, stride_key, stride_value, stride_o_t, stride_o_h, stride_block_table, min_split_pages, unsplit_pages,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PER_KV: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
    LEAN: tl.constexpr, timeline_ptr=None, TIMELINE: tl.constexpr = False, DELAY_START: tl.constexpr = 0,
    DELAY_TILE: tl.constexpr = 0,
):  # fmt: skip
    """Program (request, kv_head, split): one query token's GROUP heads over one contiguous run of
    pages. A request uses only as many of the NUM_SPLITS splits as give each at least `min_split_pages`
    pages, and one up to `unsplit_pages` (that program normalises and writes the output itself, no
    partials). With more, each writes its unnormalised partial with its running max and sum (log2
    units) and counts itself in `arrivals`; the last to arrive merges them (and resets the count). The
    last split's program first writes the token's own K/V (this kv head's) into its slot, the one place
    it is read. So a decode is one kernel: no K/V write before it, no reduction after it."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if TIMELINE:
        trow = (req * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split
        _record(timeline_ptr, trow, 0, req)
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(timeline_ptr + trow * TIMELINE_COLUMNS + TIMELINE_COLUMNS - 1, smid.to(tl.int64))
    if DELAY_START > 0:
        req = _spin(DELAY_START, req)
    # The step's metadata is read before the PDL wait (see kiln.backends.kernels.pdl): it was copied in before the step's
    # first kernel and no kernel writes it, so three dependent loads leave the chain that waits on q, k and v.
    seq_len = tl.load(seq_lens_ptr + req)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if TIMELINE:
        _record(timeline_ptr, trow, 1, slot.to(tl.int32) + seq_len)
    if USE_PDL:  # everything else it reads but the cache comes from the kernels before it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TIMELINE:
        _record(timeline_ptr, trow, 2, seq_len)
    num_pages = tl.cdiv(seq_len, BLOCK_SIZE)
    pages_per_split = tl.maximum(tl.cdiv(num_pages, NUM_SPLITS), min_split_pages)
    pages_per_split = tl.where(num_pages <= unsplit_pages, tl.maximum(num_pages, 1), pages_per_split)
    splits = tl.maximum(tl.cdiv(num_pages, pages_per_split), 1)
    if split < splits:
        start = split * pages_per_split * BLOCK_SIZE
        end = tl.minimum(start + pages_per_split * BLOCK_SIZE, seq_len)
        offs_m = tl.arange(0, GROUP)
        offs_d = tl.arange(0, HEAD_DIM_P)
        d_ok = offs_d < HEAD_DIM
        row_ok = offs_m < Q_PER_KV
        head = kv_head * Q_PER_KV + offs_m
        # q first: its load then overlaps the K/V write's, where after the write's barrier it was one more wait
        q = tl.load(q_ptr + token * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        if split == splits - 1:
            if slot >= 0:  # NOTE: as in _kv_write_kernel, a negative slot writes nowhere
                row = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d
                k_new = tl.load(key_ptr + token * stride_key + kv_head * HEAD_DIM + offs_d, mask=d_ok)
                v_new = tl.load(value_ptr + token * stride_value + kv_head * HEAD_DIM + offs_d, mask=d_ok)
                tl.store(k_cache_ptr + row, k_new, mask=d_ok)
                tl.store(v_cache_ptr + row, v_new, mask=d_ok)
            tl.debug_barrier()  # the whole program reads the slot after the threads that wrote it
        if TIMELINE:
            _record(timeline_ptr, trow, 3, seq_len)  # (in program order after the barrier)
        m_i = tl.full([GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP], tl.float32)
        acc = tl.zeros([GROUP, HEAD_DIM_P], tl.float32)
        no_causal = tl.full([GROUP], 2147483647, tl.int32)  # a decode sees its whole context
        table_row = block_table_ptr + req * stride_block_table
        if LEAN:  # full tiles without masks, then the partial one
            k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
            v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
            full_end = start + (end - start) // TILE_N * TILE_N
            for start_n in range(start, full_end, TILE_N):
                m_i, l_i, acc = _attend_decode_tile(q, m_i, l_i, acc, k_head_ptr, v_head_ptr, table_row, start_n, end,
                                                    offs_d, qk_scale, NUM_KV_HEADS * HEAD_DIM, BLOCK_SIZE, TILE_N,
                                                    False)  # fmt: skip
                if DELAY_TILE > 0:
                    _spin(DELAY_TILE, start_n)
                if TIMELINE:
                    i = (start_n - start) // TILE_N
                    if i < TIMELINE_TILES:
                        _record(timeline_ptr, trow, 4 + i, tl.max(l_i, 0).to(tl.int32, bitcast=True))
            if full_end < end:
                m_i, l_i, acc = _attend_decode_tile(q, m_i, l_i, acc, k_head_ptr, v_head_ptr, table_row, full_end, end,
                                                    offs_d, qk_scale, NUM_KV_HEADS * HEAD_DIM, BLOCK_SIZE, TILE_N,
                                                    True)  # fmt: skip
        else:
            m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, start, end,
                                          no_causal, offs_d, d_ok, qk_scale, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM,
                                          BLOCK_SIZE, TILE_N, PREFETCH_PAGES)  # fmt: skip
        if TIMELINE:
            _record(timeline_ptr, trow, 4 + TIMELINE_TILES, tl.sum(tl.sum(acc, 1), 0).to(tl.int32, bitcast=True))
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
                if NUM_SPLITS == 1 or MERGE_CHUNK == 0:
                    # NOTE: with one split this never runs (one split writes its output itself), but ptxas
                    # allocates registers for it: the one-split builds (every batch from 64 up) keep the code they
                    # were measured with — the merged-heads form below took the large-grid config from 128 to 164
                    # registers (6 programs an SM instead of 8; 256 x 256 3% slower), and fewer registers have made
                    # it slower back to back (BENCHMARKS.md, sixteenth and eighteenth sessions). MERGE_CHUNK 0: this
                    # per-head merge at any split count (merge="heads", A/B runs)
                    SPLITS_P: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
                    for i in tl.static_range(Q_PER_KV):
                        h = kv_head * Q_PER_KV + i
                        total = _merge_head(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                                            (req * NUM_HEADS + h) * NUM_SPLITS, splits,
                                            token * stride_o_t + h * stride_o_h, HEAD_DIM, HEAD_DIM_P,
                                            SPLITS_P)  # fmt: skip
                else:
                    first = (req * NUM_HEADS + kv_head * Q_PER_KV) * NUM_SPLITS
                    total = _merge_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, first, splits,
                                          token * stride_o_t + kv_head * Q_PER_KV * stride_o_h, stride_o_h, Q_PER_KV,
                                          NUM_SPLITS, HEAD_DIM, HEAD_DIM_P, MERGE_CHUNK)  # fmt: skip
                if TIMELINE:
                    t, _ = _stamp(total.to(tl.int32, bitcast=True))
                    tl.store(timeline_ptr + trow * TIMELINE_COLUMNS + TIMELINE_MERGED, t)


def decode_num_splits(num_reqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 64,
                      merge_width: int = 0) -> int:  # fmt: skip
    """The most splits that keep (requests x kv heads x splits) within one wave of the launch config: four programs
    per SM, two for the few-request config (its 128-key tile with 4 warps fits two or three an SM, by registers and
    shared memory, at the 8B's shapes); more than half of that unless one split already gives it. (Measured on the
    H200, `bench_attention.py --split-sweep`: at batch 64, 512 programs with one split beat 1,024 with two at every
    context from 256 to 32k; at batch 16, four splits were best from 2k up; at batch 1, 32 splits beat 64 — which
    ran in two waves, with twice the partials to merge — at 2k, 8k and 32k of context: 8.8, 17.4, 42.9 µs against
    10.0, 26.4, 58.4, BENCHMARKS.md, eighteenth session.) It depends only on the batch size, so a CUDA graph
    captured for one batch size keeps it; it is a power of two, so the kernel (specialised on it) has at most
    log2(max_splits) + 1 variants to compile. A request with a short context uses fewer (the kernel's
    `min_split_pages`). `merge_width` (`decode_merge_width`): the floats each split adds to the partials one
    (request, kv head)'s merge reads; no more splits than keep those within MAX_MERGE_FLOATS."""
    if merge_width and MAX_MERGE_FLOATS:
        max_splits = min(max_splits, max(1, MAX_MERGE_FLOATS // merge_width))
    per_sm = 2 if num_reqs <= FEW_REQUESTS else 4
    splits = max(1, min(max_splits, per_sm * num_sms // (num_reqs * num_kv_heads)))
    return 1 << (splits.bit_length() - 1)


def decode_merge_width(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The floats of partials a split adds to its (request, kv head)'s merge: its query heads' accumulators."""
    return num_heads // num_kv_heads * triton.next_power_of_2(head_dim)


def decode_splits(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The split count a decode-only batch runs with: by the grid, capped by the merge's partials."""
    width = decode_merge_width(num_heads, num_kv_heads, head_dim)
    return decode_num_splits(num_reqs, num_kv_heads, num_sms, merge_width=width)


# The most floats of partials the last split of a (request, kv head) merges (128 KB), which caps the split count
# where a kv head has many query heads of 128 dims: Qwen2.5-7B (7 a kv head, 4 kv heads) at batch 1 would take 64
# splits by the grid alone, its merging program then reading 229 KB in a row; at 32 its decode kernel alone on the
# H200 took 11.7-11.8 µs at 8k of context against 14.3-14.4 (16.7-16.8 -> 12.4 back to back) and at 32k 30.6-31.0
# against 29.3-29.8 (back to back 29.0-29.1 against 31.6-32.0), in two sessions (BENCHMARKS.md, nineteenth and
# twentieth); its decode step end to end within noise (251, 236, 215-217 tokens/s at 2k, 8k, 24k against 251, 235,
# 220: twenty-first). Qwen2.5-0.5B (head_dim 64: 28,672 floats at 64 splits) keeps 64, which it needs at 32k (13.0
# against 17.4 µs), and the 8B and the 1B (4 query heads a kv head) are held at 32 by the grid first. 0 turns it off
# (KILN_DECODE_MAX_MERGE_FLOATS, read once at import: A/B runs of whole decode steps).
MAX_MERGE_FLOATS = int(os.environ.get("KILN_DECODE_MAX_MERGE_FLOATS", str(32 * 1024)))


# Each decode's (request, kv head) counts its splits' arrivals (`kiln.backends.kernels.arrivals`), in one buffer per device
# big enough for any batch: 512 capture rows x 128 KV heads.
MAX_ARRIVAL_SLOTS = 512 * 128
# One key tile of the default config; 128 was as fast or slower at every batch x context of `bench_attention.py`
# (fifth session). A split is never shorter than the launch config's key tile either: at batch 1 (a 128-key tile) 64
# tokens a split half-filled every tile (1 x 2k: 13.2 against 8.8 µs, eighteenth session).
# KILN_DECODE_MIN_SPLIT_TOKENS sets it (A/B runs of whole decode steps); read once, at import.
MIN_SPLIT_TOKENS = int(os.environ.get("KILN_DECODE_MIN_SPLIT_TOKENS", "64"))
# Contexts up to this many tokens take one split whatever the batch: in a batch-1 decode step on the H200, one split
# (no partials to merge) made Llama-3.2-1B 5% faster at 32-160 tokens of context (BENCHMARKS.md, tenth session),
# where the kernel alone timed in a loop had shown no difference. KILN_DECODE_UNSPLIT_TOKENS sets it (0: off).
UNSPLIT_TOKENS = int(os.environ.get("KILN_DECODE_UNSPLIT_TOKENS", "256"))
# (TILE_N, num_warps, num_stages) of the decode kernel, from `bench_attention.py --config-sweep` on the H200 (18
# configs in two runs): 2 warps beat Triton's default 4 by 1-28% (e.g. batch 16 x 256: 10.2 against 14.1 µs), and
# in one run 64 x 2 x 3 was the fastest or within 3% of it at 12 of the 15 batch x context points (64 x 2 x 2 was
# 9% faster at batch 1 x 8k and as fast elsewhere below batch 256). At batch 256 (2,048 programs) 32 x 2 x 2 is
# faster at 256 tokens (72.9 against 84.2 µs: more programs fit an SM) and equal beyond.
# Up to FEW_REQUESTS requests, a 128-key tile with 4 warps: inside Qwen3-0.6B's batch-1 decode step on the H200 it
# made the step 8% faster (1,561 against 1,445 tokens/s in one call; the 1B as fast: BENCHMARKS.md, eleventh
# session), where the kernel alone timed in a loop had not preferred it: with one split for short contexts, a
# program walks its keys in half as many dependent iterations. At 64 splits it cost long contexts (batch 1 x 32k: 61%
# of the bandwidth against 73%); at 32, no split under its 128-key tile and the merged-heads merge it reaches 72%
# there (eighteenth session). Measured at batch 1 only (the device calls ran it up to 4 requests; 2 to 4 were not
# timed), so it holds for one request.
DECODE_CONFIG = (64, 2, 3)
DECODE_CONFIG_FEW = (128, 4, 2)
FEW_REQUESTS = 1
if os.environ.get("KILN_DECODE_CONFIG"):  # TILExWARPSxSTAGES for both (A/B runs of whole decode steps)
    DECODE_CONFIG = DECODE_CONFIG_FEW = tuple(int(v) for v in os.environ["KILN_DECODE_CONFIG"].split("x"))
DECODE_CONFIG_MANY = (32, 2, 2)  # from 2,048 programs on
# Each key tile's pages loaded an iteration ahead (`_attend_range`): Triton then double-buffers the K/V tiles from 3
# stages on. In the decode kernel no config gained from it on the H200 (12 configs x 7 batch x context points,
# `bench_attention.py --config-sweep 64x2x3p,...`; BENCHMARKS.md, fourteenth session): each program already has a tile
# of every program on its SM in flight, and the bandwidth is shared. KILN_DECODE_PREFETCH_PAGES=1 (A/B runs).
PREFETCH_PAGES = os.environ.get("KILN_DECODE_PREFETCH_PAGES", "0") == "1"
# The decode loop without masks on full tiles and with 32-bit offsets (`_attend_decode_tile`): 721 -> 503 SASS
# instructions a 64-key tile under triton 3.6, and on the H200 as fast or faster at every point timed (8 batch x
# context points, 64 x 2 x 3: e.g. 64 x 256 23.0 -> 22.3 µs, 16 x 256 11.3 -> 9.9; BENCHMARKS.md, fourteenth
# session). KILN_DECODE_LEAN=0 turns it off (A/B runs).
DECODE_LEAN = os.environ.get("KILN_DECODE_LEAN", "1") == "1"
# A probe of what the kernel's time hangs on (`split_kv_decode(delay=...)`; A/B runs of bench_attention.py and
# decode_timeline.py): each program spins START SM cycles after its start stamp, before anything else, and TILE after
# each full key tile of the lean loop. On the H200 (BENCHMARKS.md, seventeenth session), at batch 64 x 256 a
# microsecond more at the start cost a replay 1.2 µs and half a microsecond more a tile 1.1 µs (0.3 and 0.8 back to
# back); at 64 x 2k the same tile delay cost 2 µs of 125. Off (0, 0) the kernel is the same.
# KILN_DECODE_DELAY=START,TILE.
DELAY = tuple(int(v) for v in os.environ.get("KILN_DECODE_DELAY", "0,0").split(","))


def decode_config(num_programs: int, num_reqs: int) -> tuple[int, int, int]:
    """The decode kernel's launch config for a grid of `num_programs` over `num_reqs` requests: fixed by the batch
    size, so graph-safe."""
    if num_programs >= 2048:
        return DECODE_CONFIG_MANY
    return DECODE_CONFIG_FEW if num_reqs <= FEW_REQUESTS else DECODE_CONFIG


def split_kv_decode(query, key, value, kv_cache, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                    num_splits: int, min_split_tokens: int | None = None,
                    config: tuple[int, int, int] | None = None,
                    unsplit_tokens: int = UNSPLIT_TOKENS, prefetch_pages: bool | None = None,
                    lean: bool | None = None, timeline: torch.Tensor | None = None,
                    delay: tuple[int, int] = DELAY, merge: str | None = None) -> None:  # fmt: skip
    """Decode-only batch (one query per request), flash-decoding style, in one kernel that also writes the new K/V
    (key/value [R, num_kv_heads, head_dim], each token's heads contiguous): up to `num_splits` partials a request (as
    many as have `min_split_tokens` each, by default MIN_SPLIT_TOKENS or the config's key tile, whichever is more; one
    up to `unsplit_tokens`), merged by the last split to finish. `config`: (keys per tile, warps, pipeline stages), by
    default `decode_config`'s; `prefetch_pages`: load each tile's pages an iteration ahead (default PREFETCH_PAGES);
    `lean`: the lean loop (default DECODE_LEAN; not with the pages ahead). `timeline`: an int64 [programs,
    TIMELINE_COLUMNS] buffer each program stamps its progress into (programs in (request, kv head, split) order; a GPU's
    timers: not under the interpreter). `delay`: SM cycles each program spins at its start and after each full key tile
    (the probe: DELAY). `merge`: one of MERGES (default DECODE_MERGE)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    q_per_kv = num_heads // num_kv_heads
    num_reqs = metadata.seq_lens.shape[0]
    head_dim_p = triton.next_power_of_2(head_dim)
    tile_n, num_warps, num_stages = config or decode_config(num_reqs * num_kv_heads * num_splits, num_reqs)
    min_split_tokens = max(MIN_SPLIT_TOKENS, tile_n) if min_split_tokens is None else min_split_tokens
    prefetch_pages = PREFETCH_PAGES if prefetch_pages is None else prefetch_pages
    lean = (DECODE_LEAN if lean is None else lean) and not prefetch_pages and head_dim == head_dim_p
    lean = lean and kv_cache[0].numel() < 2**31  # its offsets are 32-bit
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim and value.stride(2) == 1
    part_acc = torch.empty(num_reqs, num_heads, num_splits, head_dim_p, dtype=torch.float32, device=query.device)
    part_max = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    assert num_reqs * num_kv_heads <= MAX_ARRIVAL_SLOTS
    arrivals = arrival_counts(query.device, "decode", MAX_ARRIVAL_SLOTS)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        out, part_acc, part_max, part_sum, arrivals, query, key, value, kv_cache[0], kv_cache[1],
        metadata.slot_mapping, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, scale * LOG2E,
        query.stride(0), query.stride(1), key.stride(0), value.stride(0), out.stride(0), out.stride(1),
        metadata.block_table.stride(0), max(1, -(-min_split_tokens // block_size)), unsplit_tokens // block_size,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_PER_KV=q_per_kv,
        GROUP=max(16, triton.next_power_of_2(q_per_kv)), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits,
        **merge_constexprs(merge or DECODE_MERGE, q_per_kv, head_dim_p, num_splits, num_warps),
        PREFETCH_PAGES=prefetch_pages, LEAN=lean, num_warps=num_warps, num_stages=num_stages,
        timeline_ptr=timeline, TIMELINE=timeline is not None, DELAY_START=delay[0], DELAY_TILE=delay[1],
        **pdl.launch_kwargs(query),
    )  # fmt: skip
