"""The MoE routing alone at each batch size: the single-program kernel (moe_routing.py), its parallel form (three
launches) and torch's ops, each timed inside a CUDA graph; where the first two cross is `KERNEL_MAX_PAIRS`.

    python scripts/dev/time_moe_routing.py --experts 128 --top-k 8 --tokens 1,8,32,64,128,256,512
    python scripts/dev/time_moe_routing.py --profile 8,512   # each launch of the parallel form, by torch.profiler
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import graph_time_ms  # noqa: E402

from kiln.backends.kernels import moe_routing  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,8,16,32,64,128,256,512")
    p.add_argument("--profile", default="", help="token counts at which to time each kernel of the parallel form")
    args = p.parse_args()
    for t in (int(v) for v in args.profile.split(",") if v):
        profile_parallel(t, args.experts, args.top_k)
    print(f"\nMoE routing (E={args.experts}, k={args.top_k}): us a layer, in a CUDA graph")
    print(f"{'tokens':>6} {'single':>9} {'parallel':>9} {'torch':>9}")
    for t in (int(v) for v in args.tokens.split(",")):
        single, parallel, torch_ops = time_one(t, args.experts, args.top_k)
        print(f"{t:>6} {single:>9.1f} {parallel:>9.1f} {torch_ops:>9.1f}")


def time_one(t: int, experts: int, k: int) -> tuple[float, float, float]:
    """(single program, parallel form, torch ops) microseconds of routing t tokens' logits and aligning their
    pairs."""
    logits = torch.randn(t, experts, device="cuda", dtype=torch.bfloat16)
    block_m = 16 if t * k <= 1024 else 64
    weights, chosen = _buffers(t, k)

    def kernel():
        moe_routing._launch(logits, weights, chosen, experts, k, True, True, block_m)

    def parallel():
        moe_routing._parallel(logits, weights, chosen, experts, k, True, True, block_m)

    def torch_ops():
        moe_routing.align_reference(moe_routing.route_reference(logits, k, True, torch.bfloat16)[1], experts, block_m)

    return tuple(graph_time_ms(lambda fn=fn: [fn() for _ in range(10)]) * 100 for fn in (kernel, parallel, torch_ops))


def profile_parallel(t: int, experts: int, k: int) -> None:
    """The CUDA time of each of the parallel form's three kernels at t tokens (20 runs after a warm-up)."""
    logits = torch.randn(t, experts, device="cuda", dtype=torch.bfloat16)
    weights, chosen = _buffers(t, k)
    block_m = 16 if t * k <= 1024 else 64

    def run():
        moe_routing._parallel(logits, weights, chosen, experts, k, True, True, block_m)

    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
    print(f"\nparallel form at {t} tokens, us a call:")
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            print(f"  {event.key[:60]:60} {event.device_time_total / 20:8.1f}")


def _buffers(t: int, k: int):
    return (torch.empty(t, k, device="cuda", dtype=torch.bfloat16), torch.empty(t, k, device="cuda", dtype=torch.int32))


if __name__ == "__main__":
    main()
