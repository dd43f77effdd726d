"""One-row matmuls (a batch-1 decode's linear layers): kiln's kernel beside cuBLAS, under a CUDA graph.

For each preset's four layer shapes (qkv, o, gate_up, down): cuBLAS (`F.linear`) at each row count, and
kiln's one-row kernel with its default config (with and without programmatic dependent launch: back to
back in one graph, each call's weight reads may start while the previous call finishes), for gate_up and
qkv also with the SiLU-and-mul or the rotary inside it against it followed by that kernel, and with the
layer's add + RMSNorm inside too against the norm kernel before it, and with --sweep the best of a grid of
configs. Each timing cycles through enough copies of the weight (>= 256 MB) that none is read from the 50 MB
L2, as in a real step. Bandwidth = weight bytes / time, against 4.3 TB/s.

    python scripts/bench/bench_gemv.py [--models llama-3.2-1b,qwen3-0.6b,llama-3.1-8b] [--rows 1,2,4,8] [--sweep]

(The other row counts show how cuBLAS's time grows past one row: barely, to 8.)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import graph_time_ms  # noqa: E402

from kiln.backends import environment  # noqa: E402
from kiln.backends.kernels import fused as fused_kernels  # noqa: E402
from kiln.backends.kernels import gemv as gemv_module  # noqa: E402
from kiln.backends.kernels.gemv import add_norm_linear, default_config, gemv, gemv_rope, gemv_silu_mul  # noqa: E402
from kiln.engine.models.presets import PRESETS  # noqa: E402

PEAK_BYTES_PER_S = 4.3e12


def layer_shapes(preset: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer: weight [N, K]."""
    hidden, inter = preset["hidden_size"], preset["intermediate_size"]
    head_dim = preset.get("head_dim", hidden // preset["num_attention_heads"])
    q, kv = preset["num_attention_heads"] * head_dim, preset["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def sweep_configs(k: int) -> list[tuple[int, int, int]]:
    return [
        (bn, bk, w)
        for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8))
        if bk <= triton.next_power_of_2(k) and bn * bk <= 16384
    ]


def time_us(fn, weights: list[torch.Tensor]) -> float:
    """One call's time, over a graph that calls `fn` once for every weight copy."""
    return graph_time_ms(lambda: [fn(w) for w in weights], iters=20) * 1e3 / len(weights)


def with_pdl(on: bool, fn):
    """fn() with Kiln's kernels launched with programmatic dependent launch or without (`kiln.backends.kernels.pdl`)."""
    saved = environment.ENV
    environment.ENV = dataclasses.replace(saved, pdl=on)
    try:
        return fn()
    finally:
        environment.ENV = saved


def epilogue_fns(layer: str, x: torch.Tensor, head_dim: int, rot_rows: int):
    """For the layers with an epilogue (gate_up's SiLU-and-mul, qkv's rotary; else None): (fused, unfused), and
    the same with the layer's add + RMSNorm before it: (inside the matmul, the norm kernel then the fused form)."""
    residual, norm_weight = torch.randn_like(x), torch.randn(x.shape[-1], device="cuda", dtype=torch.bfloat16)

    def norm_first(fn):
        return lambda w: fn(fused_kernels.rms_norm(x, norm_weight, 1e-6, residual)[0], w)

    if layer == "gate_up":
        return (
            (lambda w: gemv_silu_mul(x, w)),
            (lambda w: fused_kernels.silu_and_mul(gemv(x, w))),
            (lambda w: add_norm_linear(x, residual, norm_weight, 1e-6, w, epilogue="silu_mul")),
            norm_first(gemv_silu_mul),
        )
    if layer == "qkv":
        cs = torch.randn(1, head_dim, device="cuda", dtype=torch.bfloat16)
        cos, sin = cs[:, : head_dim // 2], cs[:, head_dim // 2 :]

        def unfused(w):
            y = gemv(x, w)
            heads = y[:, :rot_rows].unflatten(1, (-1, head_dim))
            return fused_kernels.rotate(heads, cos, sin, out=heads)

        return (
            (lambda w: gemv_rope(x, w, None, cos, sin, rot_rows)),
            unfused,
            (lambda w: add_norm_linear(x, residual, norm_weight, 1e-6, w, None, "rope", cos, sin, rot_rows)),
            norm_first(lambda xn, w: gemv_rope(xn, w, None, cos, sin, rot_rows)),
        )
    return None


def bench(n: int, k: int, rows: list[int], sweep: bool, layer: str = "", head_dim: int = 0, rot_rows: int = 0) -> dict:
    nbytes = n * k * 2
    copies = max(2, min(64, -(-(256 << 20) // nbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows}
    x = xs.get(1, torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    result = {
        "n": n,
        "k": k,
        "default": default_config(n, k),
        "cublas_us": {m: time_us(lambda w, m=m: F.linear(xs[m], w), weights) for m in rows},
        "kiln_us": time_us(lambda w: gemv(x, w), weights),
        "kiln_no_pdl_us": with_pdl(False, lambda: time_us(lambda w: gemv(x, w), weights)),
    }
    fns = epilogue_fns(layer, x, head_dim, rot_rows)
    if fns is not None:  # the layer's one-row kernel with its epilogue inside, against it followed by its kernel
        times = [time_us(fn, weights) for fn in fns]
        result["fused_us"], result["unfused_us"], result["norm_fused_us"], result["norm_unfused_us"] = times
    if sweep:
        times = {cfg: time_us(lambda w, cfg=cfg: gemv(x, w, None, cfg), weights) for cfg in sweep_configs(k)}
        best = min(times, key=times.get)
        result.update(best=best, best_us=times[best], sweep={",".join(map(str, c)): t for c, t in times.items()})
    weights.clear()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b,llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of (BLOCK_N, BLOCK_K, warps)")
    parser.add_argument("--json")
    args = parser.parse_args()
    gemv_module.NORM_MAX_K = 1 << 30  # "+norm": the norm inside the matmul at every K, not only where models put it
    rows = [int(m) for m in args.rows.split(",")]
    print(
        f"\none-row matmul, bf16, CUDA graph, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}; util = weight bytes / time / 4.3 TB/s; kiln at M=1"
    )
    header = f"{'model':14} {'layer':8} {'N':>6} {'K':>6} " + " ".join(f"{f'cuBLAS M={m}':>12}" for m in rows)
    header += f" {'util':>5} {'kiln us':>8} {'util':>5} {'no PDL':>7} {'+epilogue':>9} {'unfused':>8}"
    header += f" {'+norm':>7} {'norm, then':>10}"
    print(header + ("  best us  util  best (BN, BK, warps)" if args.sweep else ""), flush=True)
    results = []
    for model in args.models.split(","):
        preset = PRESETS[model]
        head_dim = preset.get("head_dim", preset["hidden_size"] // preset["num_attention_heads"])
        rot_rows = (preset["num_attention_heads"] + preset["num_key_value_heads"]) * head_dim
        for layer, (n, k) in layer_shapes(preset).items():
            r = {"model": model, "layer": layer, **bench(n, k, rows, args.sweep, layer, head_dim, rot_rows)}
            results.append(r)

            def util(us: float, n: int = n, k: int = k) -> str:
                return f"{n * k * 2 / (us * 1e-6) / PEAK_BYTES_PER_S:5.0%}"

            cublas = r["cublas_us"]
            epilogue = (
                f" {r['fused_us']:9.2f} {r['unfused_us']:8.2f} {r['norm_fused_us']:7.2f} {r['norm_unfused_us']:10.2f}"
                if "fused_us" in r
                else ""
            )
            line = (
                f"{model:14} {layer:8} {n:6} {k:6} "
                + " ".join(f"{cublas[m]:12.2f}" for m in rows)
                + f" {util(cublas[rows[0]])} {r['kiln_us']:8.2f} {util(r['kiln_us'])} {r['kiln_no_pdl_us']:7.2f}"
                + epilogue
            )
            if args.sweep:
                line += f" {r['best_us']:8.2f} {util(r['best_us'])}  {r['best']}"
            print(line, flush=True)
            if args.json:  # after every shape: a run cut short by its time limit keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.sweep:  # the configs with the lowest mean slowdown against each shape's best
        common = set.intersection(*(set(r["sweep"]) for r in results))
        mean = {c: sum(r["sweep"][c] / r["best_us"] for r in results) / len(results) for c in common}
        ranked = sorted(mean.items(), key=lambda kv: kv[1])[:5]
        print("configs by mean slowdown: " + ", ".join(f"({c}) {t:.2f}x" for c, t in ranked))


if __name__ == "__main__":
    main()
