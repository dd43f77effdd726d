"""Skinny matmuls (a small-batch decode's linear layers): kiln's kernel beside cuBLAS, under a CUDA graph.

For each preset's four layer shapes (qkv, o, gate_up, down) and each row count: cuBLAS (`F.linear`), the
skinny kernel with its default config, and with --sweep the best of a grid of configs. Each timing
cycles through enough copies of the weight (>= 256 MB) that none is read from the 50 MB L2, as in a
real step. Bandwidth = weight bytes / time, against 4.3 TB/s.

    python scripts/bench_gemv.py [--models llama-3.2-1b,qwen3-0.6b,llama-3.1-8b] [--rows 1,2,4,8] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import graph_time_ms  # noqa: E402

from kiln.backends.skinny_gemm import default_config, skinny_matmul  # noqa: E402
from kiln.engine.presets import PRESETS  # noqa: E402

PEAK_BYTES_PER_S = 4.3e12


def layer_shapes(preset: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer: weight [N, K]."""
    hidden, inter = preset["hidden_size"], preset["intermediate_size"]
    head_dim = preset.get("head_dim", hidden // preset["num_attention_heads"])
    q, kv = preset["num_attention_heads"] * head_dim, preset["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def sweep_configs(rows: int, k: int) -> list[tuple[int, int, int]]:
    block_m = triton.next_power_of_2(rows)
    return [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8))
            if bk <= triton.next_power_of_2(k) and block_m * bn * bk <= 16384]  # fmt: skip


def time_us(fn, weights: list[torch.Tensor]) -> float:
    """One call's time, over a graph that calls `fn` once for every weight copy."""
    return graph_time_ms(lambda: [fn(w) for w in weights], iters=20) * 1e3 / len(weights)


def bench(n: int, k: int, rows: int, sweep: bool) -> dict:
    nbytes = n * k * 2
    copies = max(2, min(64, -(-(256 << 20) // nbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    result = {"n": n, "k": k, "rows": rows, "default": default_config(rows, n, k),
              "cublas_us": time_us(lambda w: F.linear(x, w), weights),
              "kiln_us": time_us(lambda w: skinny_matmul(x, w), weights)}  # fmt: skip
    if sweep:
        times = {cfg: time_us(lambda w, cfg=cfg: skinny_matmul(x, w, None, cfg), weights)
                 for cfg in sweep_configs(rows, k)}  # fmt: skip
        best = min(times, key=times.get)
        result.update(best=best, best_us=times[best], sweep={",".join(map(str, c)): t for c, t in times.items()})
    del weights
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b,llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of (BLOCK_N, BLOCK_K, warps)")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"\nskinny matmul, bf16, CUDA graph, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; util = weight bytes / time / 4.3 TB/s")  # fmt: skip
    print(f"{'model':14} {'layer':8} {'N':>6} {'K':>6} {'M':>2} {'cuBLAS us':>9} {'util':>5} {'kiln us':>8} {'util':>5}"
          + ("  best us  util  best (BN, BK, warps)" if args.sweep else ""), flush=True)  # fmt: skip
    results = []
    for model in args.models.split(","):
        for layer, (n, k) in layer_shapes(PRESETS[model]).items():
            for rows in map(int, args.rows.split(",")):
                r = {"model": model, "layer": layer, **bench(n, k, rows, args.sweep)}
                results.append(r)

                def util(us: float, r: dict = r) -> str:
                    return f"{r['n'] * r['k'] * 2 / (us * 1e-6) / PEAK_BYTES_PER_S:5.0%}"

                line = (f"{model:14} {layer:8} {n:6} {k:6} {rows:2} {r['cublas_us']:9.2f} {util(r['cublas_us'])} "
                        f"{r['kiln_us']:8.2f} {util(r['kiln_us'])}")  # fmt: skip
                if args.sweep:
                    line += f" {r['best_us']:8.2f} {util(r['best_us'])}  {r['best']}"
                print(line, flush=True)
                if args.json:  # after every shape: a run cut short by its time limit keeps what it measured
                    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.sweep:  # per row count, the configs with the lowest mean slowdown against each shape's best
        for rows in map(int, args.rows.split(",")):
            group = [r for r in results if r["rows"] == rows]
            common = set.intersection(*(set(r["sweep"]) for r in group))
            mean = {c: sum(r["sweep"][c] / r["best_us"] for r in group) / len(group) for c in common}
            ranked = sorted(mean.items(), key=lambda kv: kv[1])[:5]
            print(f"M={rows}: " + ", ".join(f"({c}) {t:.2f}x" for c, t in ranked))


if __name__ == "__main__":
    main()
