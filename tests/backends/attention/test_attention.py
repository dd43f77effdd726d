"""Attention backends against a float64 reference: mixed prefill chunks and decodes, random block tables."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton

from kiln.backends.attention import (
    AttentionMetadata,
    available_backends,
    decode_merge,
    get_attention_backend,
    triton_decode,
)
from kiln.backends.attention.decode_plan import (
    DECODE_CONFIG,
    DECODE_CONFIG_FEW,
    DECODE_CONFIG_FP8_SMALL_HEADS,
    DECODE_CONFIG_MANY,
    FEW_REQUESTS,
    MAX_MERGE_FLOATS,
    WIDE_FEW_MAX_PROGRAMS,
    WIDE_FEW_WARPS,
    decode_config,
    decode_merge_width,
    decode_num_splits,
    decode_splits,
)
from kiln.backends.attention.triton_decode import split_kv_decode
from kiln.backends.attention.triton_unified import unified_attention, write_kv
from kiln.backends.kernels.arrivals import arrival_counts
from kiln.engine.config import ATTENTION_BACKENDS, EngineConfig

from helpers.attention import make_paged_batch, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-3 if DEVICE == "cuda" else 1e-5  # NOTE: fp32 tl.dot runs as TF32 on the GPU
# TF32's rounding of a dot grows with it: queries times 4 (scores a soft cap bites) take 4 times the tolerance there
SCORES_X4_TOL = 4 * TOL if DEVICE == "cuda" else TOL

CASES = [
    # (query_lens, context_lens): decodes (q=1), fresh prefills (ctx=0), chunks continuing a prefill
    ([1, 1, 1], [5, 17, 40]),
    ([7], [0]),
    ([1, 9, 1, 16, 3], [30, 0, 1, 21, 47]),
]


@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (8, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_torch_backend_matches_reference(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size):
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu"
    )
    scale = head_dim**-0.5
    out = torch.zeros_like(q)
    get_attention_backend("torch").forward(q, k, v, kv_cache, metadata, scale, out)
    torch.testing.assert_close(out.double(), reference_attention(q, history, query_lens, scale), atol=1e-5, rtol=1e-5)
    # the new K/V landed in the cache at their slots
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[metadata.slot_mapping], k)


@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (4, 2, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_backend_matches_reference(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size):
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, DEVICE
    )
    scale = head_dim**-0.5
    out = torch.zeros_like(q)
    get_attention_backend("triton").forward(q, k, v, kv_cache, metadata, scale, out)
    ref = reference_attention(q, history, query_lens, scale)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[metadata.slot_mapping], k)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_unified_kernel_page_loading(head_dim, block_size):
    """The unified kernel's pages loaded a tile ahead, with (head_dim 64) and without (80: not a power of two) the
    keys every row of a block sees in the lean loop first (a chunk with 70 tokens of context and 45 new crosses
    several tiles and pages, in both loops; the last tile runs past the table's pages in use, which the ahead load
    must mask)."""
    query_lens, context_lens = [45, 1, 9, 1], [70, 33, 0, 100]
    num_heads, num_kv_heads = 8, 2
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, DEVICE
    )
    write_kv(kv_cache, k, v, metadata.slot_mapping)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, kv_cache, metadata, head_dim**-0.5, out)
    torch.testing.assert_close(
        out.double().cpu(), reference_attention(q, history, query_lens, head_dim**-0.5), atol=TOL, rtol=TOL
    )


def with_padded_request(q, k, v, m: AttentionMetadata):
    """The batch with one more request as the runner pads one: one token, no context (seq_len 0), its K/V bound
    for the scratch block 0's first slot."""
    qsl = torch.cat([m.query_start_loc_cpu, m.query_start_loc_cpu[-1:] + 1])
    seq_lens = torch.cat([m.seq_lens_cpu, torch.zeros(1, dtype=torch.int32)])
    table = torch.cat([m.block_table, torch.zeros_like(m.block_table[:1])])
    slots = torch.cat([m.slot_mapping, torch.zeros_like(m.slot_mapping[:1])])
    padded = AttentionMetadata(
        m.num_actual_tokens + 1,
        qsl.to(q.device),
        seq_lens.to(q.device),
        table,
        slots,
        m.max_query_len,
        m.max_seq_len,
        qsl,
        seq_lens,
    )
    extra = lambda x: torch.cat([x, torch.randn_like(x[:1])])  # noqa: E731
    return extra(q), extra(k), extra(v), padded


@pytest.mark.parametrize("head_dim", [64, 80])
def test_unified_kernel_one_query_a_block_and_a_padded_request(head_dim):
    """16 query heads to a KV head (a program's block is one query token: BLOCK_Q 1) and, after the real requests,
    a padded one as the runner pads a mixed batch (one token, no context: seq_len 0): the real outputs match the
    reference, the padded row's is finite; in the lean loop (head_dim 64) and without it (80)."""
    query_lens, context_lens = [9, 1, 14], [40, 70, 0]
    num_heads, num_kv_heads = 16, 1
    q, k, v, kv_cache, m, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
    )
    write_kv(kv_cache, k, v, m.slot_mapping)
    q_padded, _, _, padded = with_padded_request(q, k, v, m)
    out = torch.full_like(q_padded, float("nan"))
    unified_attention(q_padded, kv_cache, padded, head_dim**-0.5, out)
    torch.testing.assert_close(
        out[:-1].double().cpu(), reference_attention(q, history, query_lens, head_dim**-0.5), atol=TOL, rtol=TOL
    )
    assert torch.isfinite(out[-1]).all()


@pytest.mark.parametrize("query_lens,context_lens", [CASES[2], ([1, 1, 1, 1], [3, 40, 100, 17])])
def test_triton_backend_takes_views_of_one_qkv_buffer(query_lens, context_lens):
    """The model passes q, k (rotated side by side) and v as strided views, not contiguous tensors."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
    )
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(len(q), -1, head_dim)
    q_view, k_view = qk.split([num_heads, num_kv_heads], dim=1)
    v_view = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(len(q), num_kv_heads, head_dim)
    assert not (q_view.is_contiguous() or k_view.is_contiguous() or v_view.is_contiguous())
    out = torch.zeros_like(q)
    get_attention_backend("triton").forward(q_view, k_view, v_view, kv_cache, metadata, head_dim**-0.5, out)
    ref = reference_attention(q, history, query_lens, head_dim**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    flat_v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_v[metadata.slot_mapping], v)


@pytest.mark.parametrize(
    "num_splits,min_split_tokens,config,unsplit_tokens",
    [
        (1, 16, None, 0),
        (3, 16, None, 0),
        (8, 16, None, 0),
        (1, 128, None, 0),
        (3, 128, None, 0),
        (8, 128, None, 0),
        (3, 16, DECODE_CONFIG_MANY, 0),
        (1, 16, DECODE_CONFIG_MANY, 0),
        (8, 16, None, 112),
        (3, 16, DECODE_CONFIG_FEW, 0),
        (1, 16, DECODE_CONFIG_FEW, 112),
        (8, 16, DECODE_CONFIG_MANY, 112),
        (32, 16, None, 0),
        (32, 16, DECODE_CONFIG_FEW, 0),
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (8, 2, 80)])
def test_split_kv_decode(num_splits, min_split_tokens, config, unsplit_tokens, num_heads, num_kv_heads, head_dim):
    """Contexts from under one page to many splits' worth: some requests use every split, some fewer, some one
    (written directly: also every context up to `unsplit_tokens`), in the lean loop and (head_dim 80, not a power of
    two) the general one; the last split to finish merges the rest; the new K/V reach the cache from the same kernel,
    before it reads them there: what their slots held before (NaN here) never reaches the output. Twice, because the
    arrival counts must be back at zero for the next kernel. Both launch configs (the large grids' has a smaller key
    tile). At 32 splits the 300-token request uses 19, which the last merges in steps (`merge_chunk`: 16 a step with
    two warps and 4 query heads a kv head of 64 dims, so a full step and a partial one)."""
    query_lens, context_lens = [1, 1, 1, 1, 1], [3, 40, 100, 17, 300]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
    )
    ref = reference_attention(q, history, query_lens, head_dim**-0.5)
    kv_cache.reshape(2, -1, num_kv_heads, head_dim)[:, metadata.slot_mapping] = float("nan")
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        split_kv_decode(
            q,
            k,
            v,
            kv_cache,
            metadata,
            head_dim**-0.5,
            out,
            num_splits,
            min_split_tokens,
            config,
            unsplit_tokens=unsplit_tokens,
        )
        torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
        assert not arrival_counts(q.device, "decode", triton_decode.MAX_ARRIVAL_SLOTS).any()
        # the kernel wrote each token's K/V into its slot (the reference read them from k, v)
        flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat[0, metadata.slot_mapping], k)
        torch.testing.assert_close(flat[1, metadata.slot_mapping], v)
        kv_cache.reshape(2, -1, num_kv_heads, head_dim)[:, metadata.slot_mapping] = float("nan")  # written again


@pytest.mark.parametrize("num_splits,config,unsplit_tokens", [(1, None, 0), (3, None, 0), (8, DECODE_CONFIG_MANY, 112)])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_split_kv_decode_lean_and_masked_loops(num_splits, config, unsplit_tokens, head_dim):
    """The decode loop in both forms against the reference: without masks on full tiles and with 32-bit offsets,
    then the partial tile masked (head_dim 64), and every tile masked (80, not a power of two); a padded request last
    (no context), whose output is finite and whose splits' count is back at zero."""
    query_lens, context_lens = [1, 1, 1, 1, 1], [3, 40, 100, 17, 300]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, head_dim, 16, torch.float32, DEVICE
    )
    ref = reference_attention(q, history, query_lens, head_dim**-0.5)
    kv_cache.reshape(2, -1, 2, head_dim)[:, metadata.slot_mapping] = float("nan")
    q, k, v, padded = with_padded_request(q, k, v, metadata)
    out = torch.full_like(q, float("nan"))
    split_kv_decode(
        q, k, v, kv_cache, padded, head_dim**-0.5, out, num_splits, 16, config, unsplit_tokens=unsplit_tokens
    )
    torch.testing.assert_close(out[:-1].double().cpu(), ref, atol=TOL, rtol=TOL)
    assert torch.isfinite(out[-1]).all()
    assert not arrival_counts(q.device, "decode", triton_decode.MAX_ARRIVAL_SLOTS).any()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(14, 2), (8, 8)])
def test_split_kv_decode_merge(num_heads, num_kv_heads):
    """The last split's merge against the reference, at 32 splits of 16 tokens: 7 query heads a kv head (a power of
    two padded) and one; the requests use 1, 3, 19 and all 32 splits, so the merge skips steps past the splits used
    and masks the rest of a partial step."""
    query_lens, context_lens = [1, 1, 1, 1], [10, 40, 300, 600]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, 64, 16, torch.float32, DEVICE
    )
    ref = reference_attention(q, history, query_lens, 64**-0.5)
    out = torch.full_like(q, float("nan"))
    split_kv_decode(q, k, v, kv_cache, metadata, 64**-0.5, out, 32, 16, unsplit_tokens=0)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    assert not arrival_counts(q.device, "decode", triton_decode.MAX_ARRIVAL_SLOTS).any()


def test_split_kv_decode_merge_of_wide_heads_at_64_splits():
    """Gemma 4's full layers (heads of 512, 8 query heads a kv head) at the 64 splits `decode_splits` gives them at
    batch 1: the 2,048-token request's last split merges 64 x 8 x 512 floats of partials (splits of 2 pages), the
    40-token one's 3, in steps, against the reference."""
    query_lens, context_lens = [1, 1], [40, 2048]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 16, 2, 512, 16, torch.float32, DEVICE
    )
    assert decode_splits(1, 16, 2, 512, 132) == 64
    ref = reference_attention(q, history, query_lens, 512**-0.5)
    out = torch.full_like(q, float("nan"))
    split_kv_decode(q, k, v, kv_cache, metadata, 512**-0.5, out, 64, 16, unsplit_tokens=0)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    assert not arrival_counts(q.device, "decode", triton_decode.MAX_ARRIVAL_SLOTS).any()


def test_kv_write_skips_negative_slots():
    kv_cache = torch.zeros(2, 4, 16, 2, 64, device=DEVICE)
    key = torch.randn(3, 2, 64, device=DEVICE)
    write_kv(kv_cache, key, key + 1, torch.tensor([17, -1, 63], device=DEVICE))
    flat = kv_cache.reshape(2, -1, 2, 64)
    torch.testing.assert_close(flat[0, [17, 63]], key[[0, 2]])
    torch.testing.assert_close(flat[1, [17, 63]], key[[0, 2]] + 1)
    assert flat[:, [i for i in range(64) if i not in (17, 63)]].abs().sum() == 0


def test_merge_chunk():
    """The merge's step: its loads of fp32 accumulators about 64 registers a thread, a power of two, no more than
    the splits."""
    assert decode_merge.merge_chunk(4, 128, 64, 2) == 8  # [8, 4, 128] over 64 threads: 64 a thread
    assert decode_merge.merge_chunk(4, 128, 64, 4) == 16  # [16, 4, 128] over 128 threads: 64
    assert decode_merge.merge_chunk(4, 64, 32, 2) == 16
    assert decode_merge.merge_chunk(1, 128, 3, 2) == 4  # one head: all (3, padded to 4) in one step
    for q_per_kv, head_dim, splits, warps in itertools.product((1, 2, 4, 8), (64, 128), (2, 5, 64), (1, 2, 4)):
        chunk = decode_merge.merge_chunk(q_per_kv, head_dim, splits, warps)
        assert chunk & (chunk - 1) == 0 and chunk <= triton.next_power_of_2(splits)
        per_thread = triton.next_power_of_2(q_per_kv) * chunk * head_dim / (32 * warps)
        assert per_thread <= 64 and (per_thread > 32 or chunk in (1, triton.next_power_of_2(splits)))


def test_decode_config_by_grid_size():
    assert decode_config(2047, 256) == DECODE_CONFIG != DECODE_CONFIG_MANY == decode_config(2048, 256)
    assert decode_config(4096, 512) == DECODE_CONFIG_MANY
    assert decode_config(512, 1) == decode_config(2047, FEW_REQUESTS) == DECODE_CONFIG_FEW != DECODE_CONFIG
    assert decode_config(512, FEW_REQUESTS + 1) == DECODE_CONFIG
    # heads of 256 or wider at batch 1 over at most one program an SM: 8 warps (a 16-bit cache); the widest heads
    # then take half the keys a tile
    tile_n, _, stages = DECODE_CONFIG_FEW
    assert decode_config(WIDE_FEW_MAX_PROGRAMS, 1, head_dim=256) == (tile_n, WIDE_FEW_WARPS, stages)
    assert decode_config(WIDE_FEW_MAX_PROGRAMS, 1, head_dim=512) == (tile_n // 2, WIDE_FEW_WARPS, stages)
    assert decode_config(2 * WIDE_FEW_MAX_PROGRAMS, 1, head_dim=256) == DECODE_CONFIG_FEW
    assert decode_config(WIDE_FEW_MAX_PROGRAMS, 1, head_dim=128) == DECODE_CONFIG_FEW
    assert decode_config(WIDE_FEW_MAX_PROGRAMS, 1, kv_bytes=1, head_dim=256)[1] == DECODE_CONFIG_FEW[1]
    # an FP8 cache: the same tile and warps, twice the tiles in flight; heads of 64 or fewer their own mid-batch config
    for programs, reqs, config in (
        (512, 1, DECODE_CONFIG_FEW),
        (512, 64, DECODE_CONFIG),
        (4096, 512, DECODE_CONFIG_MANY),
    ):
        tile_n, warps, stages = decode_config(programs, reqs, kv_bytes=1)
        assert (tile_n, warps, stages - 1) == (config[0], config[1], 2 * (config[2] - 1))
        small = decode_config(programs, reqs, kv_bytes=1, head_dim=64)
        assert small == (DECODE_CONFIG_FP8_SMALL_HEADS if config == DECODE_CONFIG else (tile_n, warps, stages))


@pytest.mark.parametrize("num_sms", [132, 78])
def test_warm_up_variants_fix_the_launched_decode_kernel(num_sms):
    """Warm-up compiles one decode of each `decode_variant` (the smallest batch of each): every batch size that
    shares a variant must launch the same split count and config, for either cache dtype, at the head shapes the
    presets use (heads of 64 to 512, 1 to 16 kv heads), or a CUDA graph capture would compile mid-serving."""
    backend = get_attention_backend("triton")
    backend.num_sms = num_sms
    for num_heads, num_kv_heads, head_dim in ((32, 8, 128), (16, 2, 256), (4, 1, 256), (32, 4, 512), (64, 8, 64)):
        launched: dict = {}
        for num_reqs in range(1, 513):
            splits, config = backend.decode_variant(num_reqs, num_heads, num_kv_heads, head_dim)
            programs = num_reqs * num_kv_heads * splits
            for kv_bytes in (1, 2):
                got = splits, decode_config(programs, num_reqs, kv_bytes, head_dim)
                assert launched.setdefault((splits, config, kv_bytes), got) == got, (num_reqs, head_dim, kv_bytes)


def test_decode_num_splits_fills_the_gpu():
    assert decode_num_splits(1, 8, 132) == 32  # the few-request config: two programs an SM
    assert decode_num_splits(1, 2, 132) == 64  # capped
    assert decode_num_splits(16, 8, 132) == 4
    assert decode_num_splits(64, 8, 132) == 1
    assert decode_num_splits(256, 8, 132) == 1
    for num_reqs in range(1, 513):  # one to two waves' worth of programs of the launch config, few kernel variants
        splits = decode_num_splits(num_reqs, 8, 132)
        per_sm = 2 if num_reqs <= FEW_REQUESTS else 4
        assert splits == 64 or per_sm * 132 // 2 < num_reqs * 8 * splits <= per_sm * 132 or splits == 1
    assert {decode_num_splits(n, 8, 132) for n in range(1, 513)} == {1, 2, 4, 8, 16, 32}


def test_decode_num_splits_caps_the_merge():
    """No more splits than keep the partials one (request, kv head)'s last split merges within MAX_MERGE_FLOATS,
    unless the cap would leave SMs idle: then up to one program an SM; below the cap the grid alone decides."""
    assert decode_merge_width(28, 4, 128) == 7 * 128  # Qwen2.5-7B: 7 query heads a kv head
    assert decode_merge_width(14, 2, 80) == 7 * 128  # head_dim padded to a power of two, as the partials are
    shapes = (
        (28, 4, 128),
        (14, 2, 64),
        (32, 8, 128),
        (32, 8, 64),
        (64, 8, 128),
        (8, 1, 256),
        (16, 2, 512),
        (32, 4, 512),
    )
    for heads, kv_heads, head_dim in shapes:
        width = decode_merge_width(heads, kv_heads, head_dim)
        for num_reqs in range(1, 300):
            grid = decode_num_splits(num_reqs, kv_heads, 132)
            splits = decode_num_splits(num_reqs, kv_heads, 132, merge_width=width)
            programs = num_reqs * kv_heads * splits
            assert splits * width <= MAX_MERGE_FLOATS or splits == 1 or programs <= 132
            capped = 2 * splits * width > MAX_MERGE_FLOATS and 2 * programs > 132  # (twice as many: past either)
            assert splits == grid or (splits < grid and capped)
            assert splits & (splits - 1) == 0  # a power of two: few kernel variants
    # Qwen2.5-7B at batch 1 now takes 32 splits where the grid gives 64; Qwen2.5-0.5B keeps 64
    assert decode_num_splits(1, 4, 132) == 64 == decode_num_splits(1, 2, 132, merge_width=decode_merge_width(14, 2, 64))
    assert decode_num_splits(1, 4, 132, merge_width=decode_merge_width(28, 4, 128)) == 32
    # Gemma 4's full layers at batch 1: 64 and 32 splits where the cap alone would leave 16 and 32 programs
    assert decode_splits(1, 16, 2, 512, 132) == 64 and decode_splits(1, 32, 4, 512, 132) == 32


def test_large_grid_config_runs_unsplit():
    """The large-grid config is chosen from 2,048 programs on, more than a split count above one ever gives (at
    most four programs an SM), so it never runs split: `kernel_resources.py` checks its registers at one split only."""
    for num_sms in (132, 114, 78):
        for num_kv_heads in (1, 2, 4, 8, 16, 32):
            for num_reqs in range(1, 1025):
                splits = decode_num_splits(num_reqs, num_kv_heads, num_sms)
                if decode_config(num_reqs * num_kv_heads * splits, num_reqs) == DECODE_CONFIG_MANY:
                    assert splits == 1


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch.*triton"):
        get_attention_backend("flash")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch.*triton"):
        EngineConfig(attention_backend="flash")
    # the names the flags and the config take (without importing the backends) are the registry's
    assert sorted(ATTENTION_BACKENDS) == available_backends()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1] * 30 + [64, 200], [700] * 30 + [0, 300]),  # mixed: unified kernel
        ([1] * 8, [8000, 1, 31, 16, 4000, 17, 2, 300]),  # decode only: split-KV
    ],
)
def test_backends_on_gpu_bf16_vs_fp32_reference(backend, dtype, query_lens, context_lens):
    q, k, v, kv_cache, metadata, history = make_paged_batch(query_lens, context_lens, 32, 8, 128, 16, dtype, "cuda")
    out = torch.zeros_like(q)
    get_attention_backend(backend).forward(q, k, v, kv_cache, metadata, 128**-0.5, out)
    ref = reference_attention(q, history, query_lens, 128**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 2, 256), (24, 4, 256), (16, 2, 512), (32, 4, 512)])
def test_wide_heads_at_batch_one_on_gpu(num_heads, num_kv_heads, head_dim):
    """Heads of 256 and 512 at batch 1 take decode_config's wide-head warps (qwen3.6's attention layers, Gemma 4's
    global ones; two kv heads at 64 splits, four at 32): equal to the float64 reference."""
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        [1], [5000], num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda"
    )
    backend = get_attention_backend("triton")
    splits, config = backend.decode_variant(1, num_heads, num_kv_heads, head_dim)
    assert config[1] == WIDE_FEW_WARPS and num_kv_heads * splits <= WIDE_FEW_MAX_PROGRAMS
    out = torch.zeros_like(q)
    backend.forward(q, k, v, kv_cache, metadata, head_dim**-0.5, out)
    ref = reference_attention(q, history, [1], head_dim**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 2, 80)])
def test_an_fp8_kv_cache_against_the_reference_of_its_e4m3_values(
    backend, query_lens, context_lens, num_heads, num_kv_heads, head_dim
):
    """`--kv-cache-dtype fp8`: the new K/V land as torch's e4m3 rounding of them (the kernels round by arithmetic),
    and attention over the cache equals the float64 reference over the e4m3 values of every K and V."""
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
    )
    kv_cache = _fp8(kv_cache)
    history = [(_fp8(hk).float(), _fp8(hv).float()) for hk, hv in history]
    out = torch.zeros_like(q)
    get_attention_backend(backend).forward(q, k, v, kv_cache, metadata, head_dim**-0.5, out)
    ref = reference_attention(q, history, query_lens, head_dim**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
    flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, metadata.slot_mapping].float(), _fp8(k).float())
    assert torch.equal(flat[1, metadata.slot_mapping].float(), _fp8(v).float())


def test_split_kv_decode_with_an_fp8_cache():
    """The decode kernel writes each token's K/V as e4m3 and reads the cache's e4m3 values (several splits)."""
    query_lens, context_lens = [1, 1, 1], [3, 100, 300]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, 64, 16, torch.float32, DEVICE
    )
    kv_cache = _fp8(kv_cache)
    history = [(_fp8(hk).float(), _fp8(hv).float()) for hk, hv in history]
    out = torch.zeros_like(q)
    split_kv_decode(q, k, v, kv_cache, metadata, 0.125, out, 4, 16, None)
    torch.testing.assert_close(
        out.double().cpu(), reference_attention(q, history, query_lens, 0.125), atol=TOL, rtol=TOL
    )
    assert torch.equal(kv_cache.reshape(2, -1, 2, 64)[0, metadata.slot_mapping].float(), _fp8(k).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("num_reqs", [64, 8])
def test_fp8_cache_decode_at_long_contexts_on_the_gpu(num_reqs):
    """Llama-3.2-1B's heads (head_dim 64) on an FP8 cache at ~8k keys: 64 requests take one split and
    DECODE_CONFIG_FP8_SMALL_HEADS, 8 several splits; each key read once, against the float64 reference."""
    query_lens, context_lens = [1] * num_reqs, [8191 - 37 * i for i in range(num_reqs)]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 32, 8, 64, 16, torch.float32, "cuda"
    )
    kv_cache = _fp8(kv_cache)
    history = [(_fp8(hk).float(), _fp8(hv).float()) for hk, hv in history]
    out = torch.zeros_like(q)
    get_attention_backend("triton").forward(q, k, v, kv_cache, metadata, 0.125, out)
    ref = reference_attention(q, history, query_lens, 0.125)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 2, 80)])
def test_a_sliding_window_against_the_reference(backend, window, num_heads, num_kv_heads, head_dim):
    """Decodes, fresh prefills and chunks continuing a prefill, with windows from one key to past every context
    (in the unified kernel the rows of one block start their windows at different keys)."""
    query_lens, context_lens = [1, 9, 1, 40, 3], [30, 0, 1, 21, 47]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
    )
    out = torch.zeros_like(q)
    get_attention_backend(backend).forward(q, k, v, kv_cache, metadata, head_dim**-0.5, out, window)
    ref = reference_attention(q, history, query_lens, head_dim**-0.5, window)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("window", [7, 64, 100, 5000])
@pytest.mark.parametrize("num_splits,unsplit_tokens", [(1, 0), (4, 0), (8, 112)])
def test_split_kv_decode_with_a_sliding_window(window, num_splits, unsplit_tokens):
    """The splits share the window's pages only (the pages before it are never read: here they hold NaN)."""
    query_lens, context_lens = [1, 1, 1, 1], [3, 100, 300, 17]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, 64, 16, torch.float32, DEVICE
    )
    ref = reference_attention(q, history, query_lens, 0.125, window)
    seq_lens = [c + 1 for c in context_lens]
    for i, seq_len in enumerate(seq_lens):  # every key before the window's first page: NaN
        first_page = max(seq_len - window, 0) // 16
        for page in metadata.block_table[i, :first_page].tolist():
            kv_cache[:, page] = float("nan")
    out = torch.zeros_like(q)
    split_kv_decode(q, k, v, kv_cache, metadata, 0.125, out, num_splits, 16, None, unsplit_tokens, window)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("softcap,window", [(0.5, 0), (2.0, 0), (2.0, 16), (50.0, 0)])
def test_soft_capped_scores_against_the_reference(backend, softcap, window):
    """Gemma 2's cap (softcap * tanh(s / softcap) on every score), in decodes, prefills and continued chunks, with
    and without a window; 0.5 and 2.0 cap these random scores hard (the output moves far from the uncapped one)."""
    query_lens, context_lens = [1, 9, 1, 40, 3], [30, 0, 1, 21, 47]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, 64, 16, torch.float32, DEVICE
    )
    q = q * 4  # (scores of a few units, so that a cap of 2 bites)
    out = torch.zeros_like(q)
    get_attention_backend(backend).forward(q, k, v, kv_cache, metadata, 0.125, out, window, softcap)
    ref = reference_attention(q, history, query_lens, 0.125, window, softcap)
    torch.testing.assert_close(out.double().cpu(), ref, atol=SCORES_X4_TOL, rtol=SCORES_X4_TOL)
    if softcap < 50:
        uncapped = reference_attention(q, history, query_lens, 0.125, window)
        assert (uncapped - ref).abs().max() > 0.05


@pytest.mark.parametrize("num_splits,unsplit_tokens", [(1, 0), (4, 0)])
def test_split_kv_decode_with_soft_capped_scores(num_splits, unsplit_tokens):
    query_lens, context_lens = [1, 1, 1], [3, 100, 300]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, 64, 16, torch.float32, DEVICE
    )
    q = q * 4
    out = torch.zeros_like(q)
    split_kv_decode(q, k, v, kv_cache, metadata, 0.125, out, num_splits, 16, None, unsplit_tokens, 0, 2.0)
    ref = reference_attention(q, history, query_lens, 0.125, 0, 2.0)
    torch.testing.assert_close(out.double().cpu(), ref, atol=SCORES_X4_TOL, rtol=SCORES_X4_TOL)
