"""Where the decode kernel's time goes (Llama-3.1-8B shapes, one split): the same K/V bytes read by kernels that
each keep one more of its features, beside the kernel itself and the plainest read.

    contiguous  each (request, kv head) program sums its K and V rows, pages consecutive (no block table)
    paged       ... through a random block table, as the decode kernel reads them (the K/V layout Kiln uses:
                [blocks, block size, kv heads, head dim], a head's rows 256 bytes every 2 KB)
    head-major  ... through the table from a [blocks, kv heads, block size, head dim] cache (a head's page 4 KB
                contiguous)
    paged h1st  paged, with the grid's fastest axis the kv head (a request's heads launched side by side)

Each timed a replay and eight back to back over copies of the K/V, at 2 and 4 warps (the decode kernel's tile: 64
keys, 3 stages). If `paged` is as slow as the decode kernel the time is the reading; if it is near `contiguous` and
the read, the time is the kernel's own work.

    python scripts/bench_decode_probe.py [--shapes 64x256,64x2048,256x256]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    PEAK_BYTES_PER_S,
    back_to_back_ms,
    graph_time_ms,
    kv_copies,
    read_roofline,
)

from kiln.backends import AttentionMetadata
from kiln.backends.triton_attention import decode_num_splits, split_kv_decode
from kiln.compile import pin_triton_setup


@triton.jit
def _probe_kernel(k_ptr, v_ptr, table_ptr, out_ptr, context, stride_table, PAGED: tl.constexpr,
                  HEAD_MAJOR: tl.constexpr, HEAD_FIRST: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):  # fmt: skip
    if HEAD_FIRST:
        head, req = tl.program_id(0), tl.program_id(1)
    else:
        req, head = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(0, context, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        if PAGED:
            page = tl.load(table_ptr + req * stride_table + offs_n // BLOCK_SIZE).to(tl.int64)
        else:
            page = (req * (context // BLOCK_SIZE) + offs_n // BLOCK_SIZE).to(tl.int64)
        if HEAD_MAJOR:
            row = ((page * NUM_KV_HEADS + head) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * HEAD_DIM
        else:
            row = (page * BLOCK_SIZE + offs_n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + head * HEAD_DIM
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(out_ptr + (req * NUM_KV_HEADS + head) * HEAD_DIM + offs_d, acc)


VARIANTS = {"contiguous": (False, False, False), "paged": (True, False, False), "head-major": (True, True, False),
            "paged h1st": (True, False, True)}  # fmt: skip


def bench_point(batch: int, context: int, num_sms: int) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
              for _ in range(kv_copies(kv_bytes))]  # fmt: skip
    table = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, -1)
    table = table.to(torch.int32)
    out = torch.empty(batch, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, device=device)
    row = {"batch": batch, "context": context}

    def probe(cache, variant, warps):
        paged, head_major, head_first = VARIANTS[variant]
        grid = (NUM_KV_HEADS, batch) if head_first else (batch, NUM_KV_HEADS)
        _probe_kernel[grid](cache[0], cache[1], table, out, context, table.stride(0), PAGED=paged,
                            HEAD_MAJOR=head_major, HEAD_FIRST=head_first, NUM_KV_HEADS=NUM_KV_HEADS,
                            HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, TILE_N=64, num_warps=warps,
                            num_stages=3)  # fmt: skip

    for variant in VARIANTS:
        for warps in (2, 4):
            name = f"{variant} {warps}w"
            row[name] = (graph_time_ms(lambda v=variant, w=warps: probe(caches[0], v, w)) * 1e3,
                         back_to_back_ms(lambda c, v=variant, w=warps: probe(c, v, w), caches) * 1e3)  # fmt: skip
    # the decode kernel itself on the same pages (token-major), as the backend launches it
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    slots = table[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1
    metadata = AttentionMetadata(batch, qsl.to(device), seq_lens.to(device), table, slots, 1, context, qsl, seq_lens)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_new = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_new, attn_out = torch.randn_like(k_new), torch.empty_like(q)
    splits = decode_num_splits(batch, NUM_KV_HEADS, num_sms)
    decode = lambda c: split_kv_decode(q, k_new, v_new, c, metadata, HEAD_DIM**-0.5, attn_out, splits)  # noqa: E731
    row["decode kernel"] = (graph_time_ms(lambda: decode(caches[0])) * 1e3, back_to_back_ms(decode, caches) * 1e3)
    caches = None
    row["read"] = tuple(t * 1e3 for t in read_roofline(kv_bytes, dtype))
    row["util"] = {k: tuple(kv_bytes / (t * 1e-6) / PEAK_BYTES_PER_S for t in v) for k, v in row.items()
                   if isinstance(v, tuple)}  # fmt: skip
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x256,64x2048,256x256")
    args = p.parse_args()
    pin_triton_setup()
    num_sms = torch.cuda.get_device_properties().multi_processor_count
    rows = [bench_point(*(int(v) for v in s.split("x")), num_sms) for s in args.shapes.split(",")]
    print(f"\ndecode read probe, Llama-3.1-8B shapes, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}: us a replay | eight back to back (utilisation of 4.3 TB/s)")  # fmt: skip
    for r in rows:
        print(f"batch {r['batch']} x {r['context']}")
        for name, (replay, b2b) in r["util"].items():
            print(f"  {name:<16} {r[name][0]:>8.1f} ({replay:>4.0%}) | {r[name][1]:>8.1f} ({b2b:>4.0%})")


if __name__ == "__main__":
    main()
