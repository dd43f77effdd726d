"""The FP8 one-row matmul (fp8_gemv.py) at a preset's four layer shapes (Llama-3.1-8B's by default) over launch
configs: microseconds a call and the bandwidth of its weight reads, each call on another copy of the weights (>= 256
MB of copies: a layer's e4m3 weights fit in the H200's 50 MB L2; a model's do not), inside a CUDA graph; the 16-bit
one-row matmul (gemv.py) at the same shapes beside it.

    python scripts/dev/sweep_fp8_gemv.py --configs 2x2048x4,16x1024x4 --acts token,none [--model llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import graph_time_ms  # noqa: E402
from bench_gemv import layer_shapes  # noqa: E402

from kiln.backends.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from kiln.backends.kernels.gemv import gemv  # noqa: E402
from kiln.engine.models.presets import PRESETS  # noqa: E402

CONFIGS = "2x2048x4,4x1024x4,8x1024x4,16x512x4,16x1024x4,16x1024x8,32x512x4,32x512x8,64x256x4,64x256x8"
COPY_BYTES = 256 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=CONFIGS, help="BLOCK_N x BLOCK_K x num_warps, comma-separated")
    p.add_argument("--acts", default="token,static,none")
    p.add_argument("--model", default="llama-3.1-8b", help="the preset whose layer shapes to time")
    args = p.parse_args()
    shapes = layer_shapes(PRESETS[args.model])
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    print(f"\nFP8 one-row matmul, {args.model}, us a call (GB/s of weights), {torch.cuda.get_device_name()}")
    print(f"{'act':7} {'config':12} " + " ".join(f"{name:>16}" for name in shapes) + f" {'sum us':>8}")
    cells = [(time_bf16(n, k), n * k * 2) for n, k in shapes.values()]
    row = " ".join(f"{us:7.1f} ({nbytes / us / 1e3:5.0f})" for us, nbytes in cells)
    print(f"{'bf16':7} {'default':12} {row} {sum(us for us, _ in cells):8.1f}", flush=True)
    for act in args.acts.split(","):
        best = None
        for config in [None, *configs]:
            cells, total = [], 0.0
            for n, k in shapes.values():
                us = time_one(n, k, act, config)
                total += us
                cells.append(f"{us:7.1f} ({n * k / us / 1e3:5.0f})")
            name = "default" if config is None else "x".join(map(str, config))
            print(f"{act:7} {name:12} " + " ".join(f"{c:>16}" for c in cells) + f" {total:8.1f}", flush=True)
            if config is not None and (best is None or total < best[0]):
                best = (total, name)
        print(f"{act:7} best: {best[1]} ({best[0]:.1f} us for the four layers)")


def time_one(n: int, k: int, act: str, config) -> float:
    weights = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(copies(n * k))]
    scale = torch.rand(n, device="cuda") * 0.01
    in_scale = torch.tensor([0.02], device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def calls():
        for w in weights:
            fp8_gemv(x, w, scale, in_scale if act == "static" else None, None, 0, 0, act, config)

    return graph_time_ms(calls) * 1e3 / len(weights)


def copies(nbytes: int) -> int:
    return max(4, -(-COPY_BYTES // nbytes))


def time_bf16(n: int, k: int) -> float:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies(2 * n * k))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return graph_time_ms(lambda: [gemv(x, w) for w in weights]) * 1e3 / len(weights)


if __name__ == "__main__":
    main()
