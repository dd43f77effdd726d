"""The fused expert kernels (`kiln::fused_moe` on the GPU: routing from the router's logits, alignment, the grouped
matmuls, the sum over k) alone, at a preset's layer shape: microseconds a layer and the bandwidth of the expert
weights they read, against the plain-torch loop over experts and against one bf16
dense MLP of the same active size (k experts' columns side by side, cuBLAS), each timed inside a CUDA graph (the
loop, which syncs, eagerly). Routing is uniform random, as dummy weights route.

    python scripts/bench/bench_moe.py --model qwen3-30b-a3b --tokens 1,8,64,256,2048
    python scripts/bench/bench_moe.py --tokens 1,8 --configs 16x32x128x4x4,16x64x64x4x3   # tile sweep
    python scripts/bench/bench_moe.py --model qwen3.6-35b-a3b --fp8    # FP8 experts beside (kiln::fused_moe_fp8)

`--fp8` times the same experts in e4m3 too (moe_fp8_triton.py): with a scale a 128 x 128 block, as Qwen's FP8
checkpoints ship them, and with a scale a row, as `--quantization fp8` makes them; their GB/s count the e4m3 bytes
and the scales they read.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_attention import graph_time_ms

from kiln.backends.kernels import moe_fp8_triton, moe_triton
from kiln.backends.kernels.moe import fused_moe_reference
from kiln.engine.models.source import resolve_model

PEAK_BYTES_PER_S = 4.3e12


def graph_time_us(fn, calls: int = 20) -> float:
    """Mean time of fn() among `calls` captured back to back in one CUDA graph (the replay's launch spread thin)."""
    return graph_time_ms(lambda: [fn() for _ in range(calls)]) * 1e3 / calls


def eager_time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def parse_config(text: str) -> dict[str, int]:
    m, n, k, warps, stages = (int(v) for v in text.split("x"))
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)


def fp8_experts(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weights, float32 scales) of 16-bit experts [E, N, K]: a scale a block x block block, or a row (0)."""
    w = w.float()
    if block == 0:
        scale = w.abs().amax(dim=2) / 448.0
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale
    e, n, k = w.shape
    blocks = w.view(e, n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(2, 4)) / 448.0
    return (blocks / scale[:, :, None, :, None]).view(e, n, k).to(torch.float8_e4m3fn), scale


def time_shape(num_tokens, weights_of_layers, top_k, per_expert, configs, reference, fp8=None) -> list[dict]:
    w13, w2, dense13, dense2 = weights_of_layers
    layers, (num_experts, _, hidden) = len(w13), w13[0].shape
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=x.dtype)
    weights, experts = torch.topk(logits.float().softmax(-1), top_k, dim=-1)
    weights, experts = weights.to(x.dtype), experts.to(torch.int32)
    chosen = int(torch.unique(experts).numel())
    state = {"i": 0}

    def layer() -> int:  # (read at capture: the 20 calls of a replay cycle through the layers)
        state["i"] = (state["i"] + 1) % layers
        return state["i"]

    def row(kernel: str, us: float, experts_read: int, expert_bytes: int = per_expert) -> dict:
        return dict(
            kernel=kernel,
            tokens=num_tokens,
            experts_read=experts_read,
            us=us,
            bw=experts_read * expert_bytes / us / 1e3,
        )

    rows = []
    for config in configs:

        def fused(config=config):
            i = layer()
            moe_triton.fused_moe(x, logits, w13[i], w2[i], top_k, True, x.dtype, config)

        name = "fused" if config is None else "fused " + "x".join(str(v) for v in config.values())
        rows.append(row(name, graph_time_us(fused), chosen))

    def dense():
        i = layer()
        gate, up = F.linear(x, dense13[i]).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, dense2[i])

    for block, layers_fp8 in (fp8 or {}).items():

        def fused_fp8(block=block, layers_fp8=layers_fp8):
            w13_q, s13, w2_q, s2 = layers_fp8[layer()]
            acts = "group" if block else "token"
            moe_fp8_triton.fused_moe_fp8(x, logits, w13_q, s13, w2_q, s2, top_k, True, x.dtype, block, block, acts)

        w13_q, s13, w2_q, s2 = layers_fp8[0]
        expert_bytes = w13_q[0].numel() + w2_q[0].numel() + 4 * (s13[0].numel() + s2[0].numel())
        name = f"fused fp8 {block}x{block} blocks" if block else "fused fp8, a scale a row"
        rows.append(row(name, graph_time_us(fused_fp8), chosen, expert_bytes))
    rows.append(row("dense bf16 (k experts' size)", graph_time_us(dense), top_k))
    if reference and num_tokens <= 256:
        us = eager_time_us(lambda: fused_moe_reference(x, w13[layer()], w2[layer()], weights, experts))
        rows.append(row("torch loop (reference)", us, chosen))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,256,2048")
    p.add_argument("--configs", default="", help="tile configs BMxBNxBKxWARPSxSTAGES to time besides the default")
    p.add_argument("--no-reference", action="store_true", help="skip the plain-torch loop")
    p.add_argument("--fp8", action="store_true", help="time FP8 experts too (128 x 128 blocks, a scale a row)")
    p.add_argument("--json")
    args = p.parse_args()
    c = resolve_model(args.model).model_config
    num_experts, top_k, hidden, inter = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    dtype, device = torch.bfloat16, torch.device("cuda")
    # several layers' weights, cycled, so that a layer's weights are not in the L2 cache from the call before
    layers = max(2, -(-(200 << 20) // (3 * num_experts * hidden * inter * 2)))
    w13 = [torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    w2 = [torch.randn(num_experts, hidden, inter, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    dense13 = [torch.randn(2 * top_k * inter, hidden, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    dense2 = [torch.randn(hidden, top_k * inter, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    per_expert = 3 * hidden * inter * 2
    configs = [None] + [parse_config(t) for t in args.configs.split(",") if t]
    fp8 = None
    if args.fp8:  # {block: every layer's (w13, its scales, w2, its scales)}, block 0: a scale a row
        fp8 = {block: [(*fp8_experts(a, block), *fp8_experts(b, block)) for a, b in zip(w13, w2)] for block in (128, 0)}
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        weights = (w13, w2, dense13, dense2)
        rows += time_shape(num_tokens, weights, top_k, per_expert, configs, not args.no_reference, fp8)
    print(
        f"\nfused MoE: {args.model} layer (E={num_experts}, k={top_k}, H={hidden}, I={inter}), bf16, "
        f"{torch.cuda.get_device_name()}; GB/s of the chosen experts' weights (peak {PEAK_BYTES_PER_S / 1e9:.0f})"
    )
    print(f"{'kernel':<32} {'tokens':>6} {'experts':>7} {'us':>9} {'GB/s':>7} {'% peak':>7}")
    for r in rows:
        print(
            f"{r['kernel']:<32} {r['tokens']:>6} {r['experts_read']:>7} {r['us']:>9.1f} {r['bw']:>7.0f} "
            f"{r['bw'] * 1e9 / PEAK_BYTES_PER_S:>7.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
