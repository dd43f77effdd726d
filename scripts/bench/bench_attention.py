"""Decode attention at Llama-3.1-8B shapes under a CUDA graph, beside torch SDPA; fused eager kernels
beside their plain-torch forms.

Attention: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16, random non-contiguous block
tables; batch x context grid. Bandwidth = K and V bytes read / time, against 4.3 TB/s (the H200's
measured copy bandwidth). SDPA reads the same K/V laid out contiguously ([B, 8, ctx, 128]).

Prefill (--prefill): the unified kernel on batches of prefill chunks (each request's chunk attending causally to
itself and to its cached context); FLOP/s counts the causal half. The decode kernel's split counts and launch
configs are swept by `scripts/dev/sweep_decode.py`.

    python scripts/bench/bench_attention.py [--max-tokens 4194304] [--shapes 64x256,1x32768] [--prefill]

--model PRESET times the decode points at another preset's attention shapes (its query heads, KV heads, head_dim).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from kiln.backends.attention import AttentionMetadata, get_attention_backend
from kiln.backends.attention.decode_plan import decode_splits
from kiln.backends.attention.triton_unified import unified_attention
from kiln.backends.kernels import fused as fused_kernels
from kiln.compile import pin_triton_setup
from kiln.engine.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from kiln.engine.models.presets import PRESETS

PEAK_BYTES_PER_S = 4.3e12
DECODE_BATCHES, DECODE_CONTEXTS = (1, 16, 64, 256), (256, 2048, 8192, 32768)  # the grid
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B's; --model sets the first three


def use_model_shapes(model: str, full_layers: bool = False) -> None:
    """The attention shapes of preset `model` for the decode points (the module's NUM_HEADS, NUM_KV_HEADS,
    HEAD_DIM); `full_layers`: those of its full-attention layers where they differ (Gemma 4's: heads of
    global_head_dim over num_global_key_value_heads)."""
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    p = PRESETS[model]
    NUM_HEADS, NUM_KV_HEADS = p["num_attention_heads"], p["num_key_value_heads"]
    HEAD_DIM = p.get("head_dim") or p["hidden_size"] // NUM_HEADS
    if full_layers:
        if "global_head_dim" not in p:
            raise SystemExit(f"{model}'s full-attention layers have the shapes of its others: leave out --full-layers")
        NUM_KV_HEADS = p.get("num_global_key_value_heads") or NUM_KV_HEADS
        HEAD_DIM = p["global_head_dim"]


def graph_time_ms(fn, iters: int = 50) -> float:
    """Mean time of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def back_to_back_ms(fn, caches: list, calls: int = 8) -> float:
    """Mean time of one `fn(cache)` among `calls` captured back to back in one CUDA graph, cycling over `caches`
    (copies of the K/V, so that consecutive calls share no L2 unless the whole set fits there): in the model a
    decode kernel runs inside one large graph, without the replay's own launch around each call."""
    return graph_time_ms(lambda: [fn(caches[i % len(caches)]) for i in range(calls)]) / calls


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sums ITERS consecutive blocks of x (one float out a program): a read of n elements and nothing else."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


# (elements a block, blocks a program, warps) tried for the plain read; the fastest one is reported
READ_CONFIGS = [(1024, 8, 4), (2048, 4, 4), (4096, 1, 4), (4096, 4, 8), (4096, 8, 8), (8192, 2, 8)]


def read_roofline(kv_bytes: int, dtype) -> tuple[float, float]:
    """The time of the plainest read of `kv_bytes` (contiguous, each byte once, nothing written but a float a
    program), fastest of READ_CONFIGS, a replay and back to back (ms): what any kernel reading this much can reach
    on this GPU, the ceiling the attention kernels sit under."""
    n = kv_bytes // torch.finfo(dtype).bits * 8
    xs = [torch.randn(n, dtype=dtype, device="cuda") for _ in range(kv_copies(kv_bytes))]

    def read(x, block, iters, warps):
        grid = triton.cdiv(n, block * iters)
        _read_kernel[(grid,)](x, out[:grid], n, BLOCK=block, ITERS=iters, num_warps=warps)

    out = torch.empty(triton.cdiv(n, 1024), dtype=torch.float32, device="cuda")
    times = {c: graph_time_ms(lambda c=c: read(xs[0], *c)) for c in READ_CONFIGS}
    best = min(times, key=times.get)
    return times[best], back_to_back_ms(lambda x: read(x, *best), xs)


@triton.jit
def _paged_read_kernel(
    k_ptr,
    v_ptr,
    block_table_ptr,
    out_ptr,
    stride_block_table,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Program (request, run of ROWS tokens, COLS-wide slice of a token's row): looks up the run's pages in the
    block table, then loads its K and V rows at once (nothing waits on anything but the pages) and sums them.
    WIDE: 64-bit offsets (a cache of 2**31 elements or more), as the decode kernel's."""
    req, run, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_r = run * ROWS + tl.arange(0, ROWS)
    page = tl.load(block_table_ptr + req * stride_block_table + offs_r // BLOCK_SIZE)
    if WIDE:
        page = page.to(tl.int64)
    offs = ((page * BLOCK_SIZE + offs_r % BLOCK_SIZE) * ROW + part * COLS)[:, None] + tl.arange(0, COLS)[None, :]
    total = tl.load(k_ptr + offs).to(tl.float32) + tl.load(v_ptr + offs).to(tl.float32)
    pid = (req * tl.num_programs(1) + run) * tl.num_programs(2) + part
    tl.store(out_ptr + pid, tl.sum(tl.sum(total, 1), 0))


# (tokens a program, elements of a token's row a program, warps) tried for the paged read: whole pages (all 8 heads'
# rows, 2 KB a token) and one head's slice (256 bytes a token), as the decode kernel reads them, up to a request's
# whole context a program; the fastest one is reported
PAGED_READ_CONFIGS = [
    (16, 1024, 4),
    (16, 1024, 8),
    (32, 1024, 8),
    (8, 1024, 4),
    (64, 128, 2),
    (128, 128, 4),
    (256, 128, 8),
]


def paged_read_floor(caches: list, block_table: torch.Tensor, context: int) -> tuple[float, float, dict]:
    """The time of a read of every request's K and V through its block table, the kernel's bytes and nothing else
    (fastest of PAGED_READ_CONFIGS), a replay and back to back (ms), and each config's replay (us): the floor of any
    paged kernel, which must look up a page before it reads it."""
    batch, row = block_table.shape[0], NUM_KV_HEADS * HEAD_DIM
    out = torch.empty(batch * context * NUM_KV_HEADS, dtype=torch.float32, device="cuda")

    def read(cache, rows, cols, warps):
        _paged_read_kernel[(batch, context // rows, row // cols)](
            cache[0],
            cache[1],
            block_table,
            out,
            block_table.stride(0),
            ROWS=rows,
            COLS=cols,
            ROW=row,
            BLOCK_SIZE=BLOCK_SIZE,
            WIDE=cache[0].numel() >= 2**31,
            num_warps=warps,
        )

    configs = [c for c in PAGED_READ_CONFIGS if c[0] <= context and row % c[1] == 0]
    times = {c: graph_time_ms(lambda c=c: read(caches[0], *c)) for c in configs}
    best = min(times, key=times.get)
    return (
        times[best],
        back_to_back_ms(lambda cache: read(cache, *best), caches),
        {"x".join(map(str, c)): t * 1e3 for c, t in times.items()},
    )


def kv_copies(kv_bytes: int, budget: int = 1 << 30) -> int:
    """How many copies of a K/V set of `kv_bytes` the back-to-back timing cycles over: up to 8 within 1 GiB."""
    return max(1, min(8, budget // kv_bytes))


def decode_inputs(batch: int, context: int, kv_dtype: torch.dtype = torch.bfloat16) -> tuple:
    """A decode step's inputs at the 8B's shapes: (kv_cache, metadata, q, k_new, v_new, out), each request with
    `context` tokens on random pages, its new token in its last page's last slot; the cache in `kv_dtype` (an FP8
    cache: the random values rounded to e4m3)."""
    dtype, device = torch.bfloat16, "cuda"
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device).to(kv_dtype)
    block_table = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, -1)
    block_table = block_table.to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    slot_mapping = block_table[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1  # the new token: last slot
    metadata = AttentionMetadata(
        batch, qsl.to(device), seq_lens.to(device), block_table, slot_mapping, 1, context, qsl, seq_lens
    )
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_new = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return kv_cache, metadata, q, k_new, torch.randn_like(k_new), torch.empty_like(q)


def bench_decode(batch: int, context: int, backend) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    kv_cache, metadata, q, k_new, v_new, out = decode_inputs(batch, context)
    ms = graph_time_ms(lambda: backend.forward(q, k_new, v_new, kv_cache, metadata, HEAD_DIM**-0.5, out))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    caches = [kv_cache] + [kv_cache.clone() for _ in range(kv_copies(kv_bytes) - 1)]
    b2b_ms = back_to_back_ms(lambda c: backend.forward(q, k_new, v_new, c, metadata, HEAD_DIM**-0.5, out), caches)
    chosen = decode_splits(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, backend.num_sms)
    paged_ms, paged_b2b_ms, paged_configs = paged_read_floor(caches, metadata.block_table, context)
    kv_cache = caches = None  # free them before SDPA's copy is made
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)
    sdpa = lambda kv: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, kv[0], kv[1], scale=HEAD_DIM**-0.5, enable_gqa=True
    )
    sdpa_ms = graph_time_ms(lambda: sdpa((k, v)))
    sdpa_b2b_ms = back_to_back_ms(sdpa, [(k, v)] + [(k.clone(), v.clone()) for _ in range(kv_copies(kv_bytes) - 1)])
    k = v = None
    read_ms, read_b2b_ms = read_roofline(kv_bytes, dtype)
    util = lambda t_ms: kv_bytes / (t_ms * 1e-3) / PEAK_BYTES_PER_S  # noqa: E731
    return {
        "batch": batch,
        "context": context,
        "kiln_us": ms * 1e3,
        "kiln_util": util(ms),
        "sdpa_us": sdpa_ms * 1e3,
        "sdpa_util": util(sdpa_ms),
        "splits": chosen,
        "kiln_b2b_us": b2b_ms * 1e3,
        "kiln_b2b_util": util(b2b_ms),
        "sdpa_b2b_us": sdpa_b2b_ms * 1e3,
        "sdpa_b2b_util": util(sdpa_b2b_ms),
        "read_us": read_ms * 1e3,
        "read_util": util(read_ms),
        "read_b2b_us": read_b2b_ms * 1e3,
        "read_b2b_util": util(read_b2b_ms),
        "paged_us": paged_ms * 1e3,
        "paged_util": util(paged_ms),
        "paged_b2b_us": paged_b2b_ms * 1e3,
        "paged_b2b_util": util(paged_b2b_ms),
        "paged_config_us": paged_configs,
    }


def bench_window(batch: int, context: int, window: int, backend) -> dict:
    """A sliding layer's decode (it reads the last `window` keys of each context) against a full layer's, both
    back to back over copies of the K/V."""
    kv_cache, metadata, q, k_new, v_new, out = decode_inputs(batch, context)
    caches = [kv_cache] + [
        kv_cache.clone() for _ in range(kv_copies(2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2) - 1)
    ]

    def run(w):
        return lambda c: backend.forward(q, k_new, v_new, c, metadata, HEAD_DIM**-0.5, out, w)

    full_ms, window_ms = back_to_back_ms(run(0), caches), back_to_back_ms(run(window), caches)
    window_bytes = 2 * batch * min(window, context) * NUM_KV_HEADS * HEAD_DIM * 2
    return {
        "batch": batch,
        "context": context,
        "window": window,
        "full_us": full_ms * 1e3,
        "window_us": window_ms * 1e3,
        "window_util": window_bytes / (window_ms * 1e-3) / PEAK_BYTES_PER_S,
    }


# (requests, new tokens a request, cached tokens a request) of the prefill points
PREFILL_SHAPES = [(1, 2048, 0), (8, 512, 0), (4, 512, 2048), (1, 512, 16384), (16, 128, 1024)]


def bench_prefill(reqs: int, new: int, cached: int) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    seq = cached + new
    blocks_per_seq = triton.cdiv(seq, BLOCK_SIZE)
    num_blocks = reqs * blocks_per_seq + 1
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    block_table = (torch.randperm(num_blocks - 1, device=device) + 1).view(reqs, -1).to(torch.int32)
    qsl = torch.arange(0, (reqs + 1) * new, new, dtype=torch.int32)
    seq_lens = torch.full((reqs,), seq, dtype=torch.int32)
    slots = torch.zeros(reqs * new, dtype=torch.int64, device=device)  # unused: the kernel reads the cache only
    metadata = AttentionMetadata(
        reqs * new, qsl.to(device), seq_lens.to(device), block_table, slots, new, seq, qsl, seq_lens
    )
    q = torch.randn(reqs * new, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    out = torch.empty_like(q)
    us = graph_time_ms(lambda: unified_attention(q, kv_cache, metadata, HEAD_DIM**-0.5, out)) * 1e3
    flops = 4 * reqs * NUM_HEADS * HEAD_DIM * new * (cached + (new + 1) / 2)  # QK^T and PV over the visible keys
    return {"reqs": reqs, "new": new, "cached": cached, "us": us, "tflops": flops / us * 1e-6}


def bench_fused(num_tokens: int, hidden: int = 4096, intermediate: int = 14336) -> list[dict]:
    dtype, device = torch.bfloat16, "cuda"
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    r = torch.randn_like(x)
    norm = RMSNorm(hidden, 1e-5).to(device, dtype)
    rope = RotaryEmbedding(HEAD_DIM, 8192, 500000.0, None).to(device)
    qk = torch.randn(num_tokens, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    pos = torch.randint(0, 8192, (num_tokens,), device=device)
    gate_up = torch.randn(num_tokens, 2 * intermediate, dtype=dtype, device=device)
    cases = {
        "rms_norm+residual": (lambda: norm(x, r), lambda: fused_kernels.rms_norm(x, norm.weight, 1e-5, r)),
        "rope q,k": (lambda: rope(pos, qk), lambda: fused_kernels.rotary_embedding(qk, pos, rope.cos_sin)),
        "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: fused_kernels.silu_and_mul(gate_up)),
    }
    rows = []
    for name, (plain, fused) in cases.items():
        rows.append(
            {
                "kernel": name,
                "tokens": num_tokens,
                "torch_us": triton.testing.do_bench(plain) * 1e3,
                "triton_us": triton.testing.do_bench(fused) * 1e3,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=4 << 20, help="skip batch x context above this (memory)")
    p.add_argument("--json")
    p.add_argument("--shapes", default="", help="only these BATCHxCONTEXT points, e.g. 64x256,1x32768")
    p.add_argument("--prefill", action="store_true", help="also time the unified kernel on prefill chunks")
    p.add_argument("--window", type=int, default=0, help="also time a sliding layer of this window at each point")
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        choices=sorted(PRESETS),
        help="the decode points at this preset's attention shapes",
    )
    args = p.parse_args()
    use_model_shapes(args.model)
    pin_triton_setup()  # the kernels built as the engine builds them (its ptxas and libdevice)
    shapes = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s}
    grid = {(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS}
    if shapes - grid:  # a point outside the grid would be passed over without a word
        raise SystemExit(
            f"--shapes {args.shapes}: not in the grid (batch {DECODE_BATCHES} x context "
            f"{DECODE_CONTEXTS}): {sorted(shapes - grid)}"
        )
    backend = get_attention_backend("triton")
    rows = []
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            if batch * context <= args.max_tokens and (not shapes or (batch, context) in shapes):
                rows.append(bench_decode(batch, context, backend))
                torch.cuda.empty_cache()
    print(
        f"\ndecode attention, {args.model} shapes ({NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim "
        f"{HEAD_DIM}), bf16, CUDA graph, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}; util = KV bytes / time / 4.3 TB/s"
    )
    print(
        "one call a replay | eight calls back to back in one graph, over copies of the K/V (b2b); read: the "
        "plainest read of the same bytes (the ceiling); paged: the same K/V read through the block table, nothing "
        "else computed (the floor of a paged kernel)"
    )
    print(
        f"{'batch':>5} {'context':>7} {'kiln us':>9} {'kiln util':>9} {'sdpa us':>9} {'sdpa util':>9} | "
        f"{'kiln b2b':>9} {'util':>5} {'sdpa b2b':>9} {'util':>5} | "
        f"{'read us':>8} {'util':>5} {'read b2b':>8} {'util':>5} | {'paged us':>8} {'util':>5} {'paged b2b':>8} "
        f"{'util':>5}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['kiln_us']:>9.1f} {r['kiln_util']:>9.0%} "
            f"{r['sdpa_us']:>9.1f} {r['sdpa_util']:>9.0%} | {r['kiln_b2b_us']:>9.1f} {r['kiln_b2b_util']:>5.0%} "
            f"{r['sdpa_b2b_us']:>9.1f} {r['sdpa_b2b_util']:>5.0%} | {r['read_us']:>8.1f} {r['read_util']:>5.0%} "
            f"{r['read_b2b_us']:>8.1f} {r['read_b2b_util']:>5.0%} | {r['paged_us']:>8.1f} {r['paged_util']:>5.0%} "
            f"{r['paged_b2b_us']:>8.1f} {r['paged_b2b_util']:>5.0%}"
        )
    paged_names = sorted(
        {c for r in rows for c in r["paged_config_us"]},
        key=lambda c: PAGED_READ_CONFIGS.index(tuple(int(v) for v in c.split("x"))),
    )
    print(
        f"\n{'batch':>5} {'context':>7} "
        + " ".join(f"{c:>11}" for c in paged_names)
        + "   (paged read, tokens x row elements x warps a program, us, a replay)"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} "
            + " ".join(f"{r['paged_config_us'].get(c, float('nan')):>11.1f}" for c in paged_names)
        )
    windowed = [bench_window(r["batch"], r["context"], args.window, backend) for r in rows] if args.window else []
    if windowed:
        print(f"\nsliding-window decode (window {args.window}) against a full layer, back to back, us")
        print(f"{'batch':>5} {'context':>7} {'full':>9} {'window':>9} {'util of the window':>18}")
        for r in windowed:
            print(
                f"{r['batch']:>5} {r['context']:>7} {r['full_us']:>9.1f} {r['window_us']:>9.1f} "
                f"{r['window_util']:>18.0%}"
            )
    prefill = [bench_prefill(*shape) for shape in PREFILL_SHAPES] if args.prefill else []
    if prefill:
        print(f"\nprefill attention (unified kernel), {args.model} shapes, bf16, CUDA graph")
        print(f"{'reqs':>4} {'new':>5} {'cached':>6} {'us':>9} {'TFLOP/s':>8}")
        for r in prefill:
            print(f"{r['reqs']:>4} {r['new']:>5} {r['cached']:>6} {r['us']:>9.1f} {r['tflops']:>8.1f}")
    fused = bench_fused(1) + bench_fused(4096)
    print(f"\n{'fused kernel':<20} {'tokens':>6} {'torch us':>9} {'triton us':>9}")
    for r in fused:
        print(f"{r['kernel']:<20} {r['tokens']:>6} {r['torch_us']:>9.1f} {r['triton_us']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode": rows, "prefill": prefill, "fused": fused, "window": windowed}, f, indent=1)


if __name__ == "__main__":
    main()
