"""The FP8 one-row matmul (fp8_gemv.py) at Llama-3.1-8B's four layer shapes over launch configs: microseconds a call
and the bandwidth of its weight reads, each call on another copy of the weights (a layer's e4m3 weights fit in the
H200's 50 MB L2; a model's do not), inside a CUDA graph.

    python scripts/dev/sweep_fp8_gemv.py --configs 2x2048x4,16x1024x4 --acts token,none
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import graph_time_ms  # noqa: E402

from kiln.backends.kernels.fp8_gemv import fp8_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = "2x2048x4,4x1024x4,8x1024x4,16x512x4,16x1024x4,16x1024x8,32x512x4,32x512x8,64x256x4,64x256x8"
COPIES = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=CONFIGS, help="BLOCK_N x BLOCK_K x num_warps, comma-separated")
    p.add_argument("--acts", default="token,static,none")
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    print(f"\nFP8 one-row matmul, us a call (GB/s of weights), {torch.cuda.get_device_name()}")
    print(f"{'act':7} {'config':12} " + " ".join(f"{name:>16}" for name in SHAPES) + f" {'sum us':>8}")
    for act in args.acts.split(","):
        best = None
        for config in [None, *configs]:
            cells, total = [], 0.0
            for n, k in SHAPES.values():
                us = time_one(n, k, act, config)
                total += us
                cells.append(f"{us:7.1f} ({n * k / us / 1e3:5.0f})")
            name = "default" if config is None else "x".join(map(str, config))
            print(f"{act:7} {name:12} " + " ".join(f"{c:>16}" for c in cells) + f" {total:8.1f}", flush=True)
            if config is not None and (best is None or total < best[0]):
                best = (total, name)
        print(f"{act:7} best: {best[1]} ({best[0]:.1f} us for the four layers)")


def time_one(n: int, k: int, act: str, config) -> float:
    weights = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(COPIES)]
    scale = torch.rand(n, device="cuda") * 0.01
    in_scale = torch.tensor([0.02], device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def calls():
        for w in weights:
            fp8_gemv(x, w, scale, in_scale if act == "static" else None, None, 0, 0, act, config)

    return graph_time_ms(calls) * 1e3 / COPIES


if __name__ == "__main__":
    main()
