"""gpt-oss's experts (`kiln::gpt_oss_moe`) alone at a model's layer: microseconds a layer and the bandwidth of the
expert bytes a step reads (the chosen experts' 4-bit weights, their scales and biases), MXFP4 against 16-bit experts
of the same shape. On a GPU the Triton kernels, each timed inside a CUDA graph (a replay cycles through `--layers`
layers' weights, so the L2 cache does not hold them); on the CPU the plain-torch form, eagerly (a check that the
script runs, not a figure). Routing is uniform random, as dummy weights route: at T tokens E * (1 - (1 - k/E)^T)
experts are read.

    python scripts/bench/bench_gpt_oss_moe.py --model gpt-oss-120b --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048
    python scripts/bench/bench_gpt_oss_moe.py --model gpt-oss-20b --tokens 1,8 --formats mxfp4
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch

from kiln.backends.kernels import gpt_oss_moe as moe_op
from kiln.backends.kernels import mxfp4
from kiln.engine.models.source import resolve_model

PEAK_BYTES_PER_S = 4.3e12  # the H200's HBM3e; the H100's is 3.35e12


def expert_tensors(num_experts: int, hidden: int, inter: int, fmt: str, device: str) -> dict[str, torch.Tensor]:
    """One layer's experts as `kiln::gpt_oss_moe` takes them, random (MXFP4: every code equally likely, blocks scaled
    by 2^-7, as the dummy loader draws them)."""
    if fmt == "mxfp4":
        w13 = torch.randint(0, 256, (num_experts, 2 * inter, hidden // 2), dtype=torch.uint8, device=device)
        w2 = torch.randint(0, 256, (num_experts, hidden, inter // 2), dtype=torch.uint8, device=device)
        scales = {
            "w13_scale": torch.full((num_experts, 2 * inter, hidden // mxfp4.BLOCK), 120, dtype=torch.uint8),
            "w2_scale": torch.full((num_experts, hidden, inter // mxfp4.BLOCK), 120, dtype=torch.uint8),
        }
        scales = {k: v.to(device) for k, v in scales.items()}
    else:
        w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device) * 0.02
        w2 = torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=device) * 0.02
        scales = {}
    biases = {
        "w13_bias": torch.randn(num_experts, 2 * inter, dtype=torch.bfloat16, device=device) * 0.02,
        "w2_bias": torch.randn(num_experts, hidden, dtype=torch.bfloat16, device=device) * 0.02,
    }
    return {"w13": w13, "w2": w2, **scales, **biases}


def bytes_per_expert(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors.values())


def time_us(fn, device: str, calls: int = 20) -> float:
    """Mean time of fn(): on the GPU `calls` captured back to back in one CUDA graph; on the CPU eagerly."""
    if device == "cuda":
        from bench_attention import graph_time_ms  # noqa: PLC0415  (CUDA only)

        return graph_time_ms(lambda: [fn() for _ in range(calls)]) * 1e3 / calls
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e6


def cycling(moe, layers: list[dict[str, torch.Tensor]], routed: tuple, alpha: float, limit: float):
    """A call of the experts on `routed` (x, weights, chosen), each call on the next layer's weights (read at capture:
    a replay cycles through the layers)."""
    state = {"i": 0}

    def step() -> None:
        state["i"] = (state["i"] + 1) % len(layers)
        t = layers[state["i"]]
        moe(
            *routed,
            moe_op.Experts(
                t["w13"], t["w13_bias"], t["w2"], t["w2_bias"], alpha, limit, t.get("w13_scale"), t.get("w2_scale")
            ),
        )

    return step


def parse_configs(text: str) -> list[dict[str, int] | None]:
    """`BMxBNxBKxWARPSxSTAGES,...` (e.g. 16x32x128x4x4) as tile configs, after None (tile_config's own choice)."""
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return [None] + [dict(zip(keys, map(int, c.split("x")), strict=True)) for c in text.split(",") if c]


def config_name(config: dict[str, int] | None) -> str:
    return "auto" if config is None else "x".join(str(v) for v in config.values())


def run(
    model: str, tokens: list[int], formats: list[str], num_layers: int, device: str, configs: list | None = None
) -> list[dict]:
    config = resolve_model(model).model_config
    experts, hidden, inter, top_k = (
        config.num_experts,
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts_per_tok,
    )
    alpha, limit = config.swiglu_alpha, config.swiglu_limit
    if device == "cuda":
        from kiln.backends.kernels.gpt_oss_moe_triton import gpt_oss_moe  # noqa: PLC0415  (CUDA only)
    else:
        gpt_oss_moe = moe_op.gpt_oss_moe_reference
    rows = []
    for fmt in formats:
        layers = [expert_tensors(experts, hidden, inter, fmt, device) for _ in range(num_layers)]
        per_expert = bytes_per_expert(layers[0])
        for num_tokens, config in itertools.product(tokens, configs or [None]):
            x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
            top, chosen = torch.topk(torch.randn(num_tokens, experts, device=device), top_k, dim=-1)
            weights, chosen = torch.softmax(top, dim=-1).to(x.dtype), chosen.to(torch.int32)
            read = int(torch.unique(chosen).numel())
            moe = gpt_oss_moe if config is None else functools.partial(gpt_oss_moe, config=config)
            us = time_us(cycling(moe, layers, (x, weights, chosen), alpha, limit), device)
            gb_per_s = read * per_expert / us / 1e3
            rows.append(
                dict(
                    format=fmt,
                    config=config_name(config),
                    tokens=num_tokens,
                    experts_read=read,
                    mb_read=read * per_expert / 1e6,
                    us=us,
                    gb_per_s=gb_per_s,
                    roofline=gb_per_s * 1e9 / PEAK_BYTES_PER_S,
                )
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-120b", help="a gpt-oss preset or model directory (its layer's shape)")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    p.add_argument("--formats", default="mxfp4,bf16")
    p.add_argument("--layers", type=int, default=4, help="layers' weights a timing cycles through")
    p.add_argument("--configs", default="", help="tiles to sweep beside the default: BMxBNxBKxWARPSxSTAGES,... (GPU)")
    p.add_argument("--json")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = parse_configs(args.configs) if device == "cuda" else None
    rows = run(args.model, tokens, args.formats.split(","), args.layers, device, configs)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (the plain-torch form: no figure)"
    print(f"gpt-oss MoE {args.model} on {where}, torch {torch.__version__}; roofline {PEAK_BYTES_PER_S / 1e12} TB/s")
    head = f"{'format':7} {'tokens':>6} {'config':>14} {'experts':>7} {'MB read':>8} {'us':>9} {'GB/s':>8}"
    print(f"{head} {'roofline':>8}")
    for r in rows:
        print(
            f"{r['format']:7} {r['tokens']:6} {r['config']:>14} {r['experts_read']:7} {r['mb_read']:8.1f} "
            f"{r['us']:9.1f} {r['gb_per_s']:8.1f} {r['roofline']:8.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": where, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
