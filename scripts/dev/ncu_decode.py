"""The decode kernel and the plainest read of the same K/V bytes, each launched twice at each shape, eagerly: a
driver for Nsight Compute (`ncu`), which profiles each launch (`scripts/bench/gpu_check.sh ncu`):

    ncu --section SpeedOfLight --section WarpStateStats ... python scripts/dev/ncu_decode.py --shapes 64x256,64x2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _read_kernel, decode_inputs  # noqa: E402

from kiln.backends.attention.decode_plan import decode_splits  # noqa: E402
from kiln.backends.attention.triton_decode import split_kv_decode  # noqa: E402
from kiln.compile import pin_triton_setup  # noqa: E402

READ_CONFIG = (4096, 4, 8)  # elements a block, blocks a program, warps: among the fastest on the H200


def run_point(batch: int, context: int, num_sms: int) -> None:
    kv_cache, metadata, q, k_new, v_new, out = decode_inputs(batch, context)
    splits = decode_splits(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, num_sms)
    for _ in range(2):
        split_kv_decode(q, k_new, v_new, kv_cache, metadata, HEAD_DIM**-0.5, out, splits)
    n = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    x = kv_cache.view(-1)[:n]
    block, iters, warps = READ_CONFIG
    grid = triton.cdiv(n, block * iters)
    sums = torch.empty(grid, dtype=torch.float32, device="cuda")
    for _ in range(2):
        _read_kernel[(grid,)](x, sums, n, BLOCK=block, ITERS=iters, num_warps=warps)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x256,64x2048")
    args = p.parse_args()
    pin_triton_setup()
    num_sms = torch.cuda.get_device_properties().multi_processor_count
    for shape in args.shapes.split(","):
        run_point(*(int(v) for v in shape.split("x")), num_sms)


if __name__ == "__main__":
    main()
