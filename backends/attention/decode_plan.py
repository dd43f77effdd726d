"""How a decode-only batch runs the split-KV kernel: its split count and launch config, fixed by the batch size
(so graph-safe) and sized from sweeps on the GPU."""

from __future__ import annotations

import triton

# The most floats of partials the last split of a (request, kv head) merges (128 KB). It caps the split count where a
# kv head has many query heads of 128 dims (Qwen2.5-7B: 7 a kv head), whose merging program would otherwise read
# hundreds of KB in a row; models with 4 query heads a kv head are held at 32 splits by the grid first. It gives way
# where it would leave SMs without a program (`decode_num_splits`).
MAX_MERGE_FLOATS = 32 * 1024
# The smallest split, in tokens: one key tile of the default config (a split never takes less than the launch
# config's key tile either: a half-filled tile costs as much as a full one).
MIN_SPLIT_TOKENS = 64
# Contexts up to this many tokens take one split whatever the batch: no partials to merge, which is faster for short
# contexts at batch 1.
UNSPLIT_TOKENS = 256
# (TILE_N, num_warps, num_stages) of the decode kernel, from sweeps of `scripts/bench/bench_attention.py`: 2 warps beat
# Triton's default 4 below batch 256; from 2,048 programs on a 32-key tile fits more programs an SM. Up to
# FEW_REQUESTS requests a 128-key tile with 4 warps (8 at wide heads, below): with one split for a short context, a
# program walks its keys in half as many dependent iterations.
DECODE_CONFIG = (64, 2, 3)
DECODE_CONFIG_FEW = (128, 4, 2)
DECODE_CONFIG_MANY = (32, 2, 2)
# An FP8 cache at heads of 64 or fewer, ranked inside the engine (scripts/dev/profile_step.py --kv-cache-dtype fp8
# --prompt-len 8192): the kernel alone (scripts/dev/sweep_decode.py) ranks these configs otherwise.
DECODE_CONFIG_FP8_SMALL_HEADS = (128, 2, 3)
FEW_REQUESTS = 1
# Heads of 256 or wider at batch 1 over a grid of at most WIDE_FEW_MAX_PROGRAMS programs (about one an SM: two kv heads
# at 64 splits, four at 32): 8 warps, since a program with an SM to itself streams a long context faster with more
# loads in flight; a larger grid (eight kv heads) shares its SMs and keeps 4.
WIDE_FEW_WARPS = 8
WIDE_FEW_MAX_PROGRAMS = 128


def decode_num_splits(
    num_reqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 64, merge_width: int = 0
) -> int:
    """The most splits that keep (requests x kv heads x splits) within one wave of the launch config: four programs
    per SM, two for the few-request config (its 128-key tile with 4 warps fits two or three an SM, by registers and
    shared memory); more than half of that unless one split already gives it (a second wave, with twice the
    partials to merge, was slower at every context measured). It depends only on the batch size, so a CUDA graph
    captured for one batch size keeps it; it is a power of two, so the kernel (specialised on it) has at most
    log2(max_splits) + 1 variants to compile. A request with a short context uses fewer (the kernel's
    `min_split_pages`). `merge_width` (`decode_merge_width`): the floats each split adds to the partials one
    (request, kv head)'s merge reads; no more splits than keep those within MAX_MERGE_FLOATS, unless that would
    leave SMs without a program (wide heads over few kv heads, Gemma 4's full layers: a handful of programs reading
    a long context one SM each cost far more than a larger merge)."""
    if merge_width:
        one_wave = num_sms // (num_reqs * num_kv_heads)  # (one program an SM)
        max_splits = min(max_splits, max(1, MAX_MERGE_FLOATS // merge_width, one_wave))
    per_sm = 2 if num_reqs <= FEW_REQUESTS else 4
    splits = max(1, min(max_splits, per_sm * num_sms // (num_reqs * num_kv_heads)))
    return 1 << (splits.bit_length() - 1)


def decode_merge_width(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The floats of partials a split adds to its (request, kv head)'s merge: its query heads' accumulators."""
    return num_heads // num_kv_heads * triton.next_power_of_2(head_dim)


def decode_splits(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The split count a decode-only batch runs with: by the grid, capped by the merge's partials where the GPU stays
    full without them (`decode_num_splits`)."""
    width = decode_merge_width(num_heads, num_kv_heads, head_dim)
    return decode_num_splits(num_reqs, num_kv_heads, num_sms, merge_width=width)


def decode_config(num_programs: int, num_reqs: int, kv_bytes: int = 2, head_dim: int = 128) -> tuple[int, int, int]:
    """The decode kernel's launch config for a grid of `num_programs` over `num_reqs` requests: fixed by the batch
    size, so graph-safe. Heads of 256 or wider at batch 1 on a small grid take WIDE_FEW_WARPS; heads of 512 half the
    keys a tile. An FP8 cache (`kv_bytes` 1) takes `fp8_decode_config`'s."""
    if num_programs >= 2048:
        config = DECODE_CONFIG_MANY
    else:
        config = DECODE_CONFIG_FEW if num_reqs <= FEW_REQUESTS else DECODE_CONFIG
    if config == DECODE_CONFIG_FEW and head_dim >= 256 and num_programs <= WIDE_FEW_MAX_PROGRAMS and kv_bytes == 2:
        config = config[0], WIDE_FEW_WARPS, config[2]
    if head_dim > 256:  # (heads of 512, Gemma 4's global layers: as many bytes a tile as heads of 256 take)
        tile_n, num_warps, num_stages = config
        config = max(16, tile_n * 256 // triton.next_power_of_2(head_dim)), num_warps, num_stages
    return fp8_decode_config(config, head_dim) if kv_bytes == 1 else config


def fp8_decode_config(config: tuple[int, int, int], head_dim: int) -> tuple[int, int, int]:
    """A 16-bit cache's `config` for an FP8 cache: the same tile and warps with twice the tiles in flight (stages - 1),
    since a tile then holds half the bytes and as many bytes in flight keep the memory busy; except DECODE_CONFIG at
    heads of 64 or fewer, which takes DECODE_CONFIG_FP8_SMALL_HEADS: twice the keys a tile, as many bytes as a 16-bit
    tile of 64 keys."""
    if config == DECODE_CONFIG and head_dim <= 64:
        return DECODE_CONFIG_FP8_SMALL_HEADS
    tile_n, num_warps, num_stages = config
    return tile_n, num_warps, 2 * num_stages - 1
