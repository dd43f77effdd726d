"""The decode kernel and the plainest read of the same K/V bytes, each launched twice at each shape, eagerly: a
driver for Nsight Compute (`ncu`), which profiles each launch (`scripts/gpu_check.sh ncu`):

    ncu --section SpeedOfLight --section WarpStateStats ... python scripts/ncu_decode.py --shapes 64x256,64x2048
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_attention import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _read_kernel

from kiln.backends import AttentionMetadata
from kiln.backends.triton_attention import decode_num_splits, split_kv_decode
from kiln.compile import pin_triton_setup

READ_CONFIG = (4096, 4, 8)  # elements a block, blocks a program, warps: among the fastest on the H200


def run_point(batch: int, context: int, num_sms: int) -> None:
    dtype, device = torch.bfloat16, "cuda"
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    table = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, -1)
    table = table.to(torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    slots = table[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1
    metadata = AttentionMetadata(batch, qsl.to(device), seq_lens.to(device), table, slots, 1, context, qsl, seq_lens)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_new = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_new, out = torch.randn_like(k_new), torch.empty_like(q)
    splits = decode_num_splits(batch, NUM_KV_HEADS, num_sms)
    for _ in range(2):
        split_kv_decode(q, k_new, v_new, kv_cache, metadata, HEAD_DIM**-0.5, out, splits)
    n = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    x = kv_cache.view(-1)[:n]
    block, iters, warps = READ_CONFIG
    grid = triton.cdiv(n, block * iters)
    sums = torch.empty(grid, dtype=torch.float32, device=device)
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
