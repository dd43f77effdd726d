"""Where a decode kernel's time goes, program by program: each program of the decode kernel stamps the GPU's global
timer (and its SM's cycle counter) at its start, once its metadata has arrived, after the PDL wait, after the K/V
write's barrier, after each key tile and at its end (`TIMELINE`), under a CUDA graph as `bench_attention.py` times it:
a replay of one call, and eight calls back to back over copies of the K/V.

    python scripts/decode_timeline.py [--shapes 64x256,64x2048] [--raw out.pt]
"""

from __future__ import annotations

import argparse

import bench_attention as ba
import torch

from kiln.backends.triton_decode import decode_num_splits, split_kv_decode
from kiln.compile import pin_triton_setup

POINTS = {0: "start", 1: "metadata", 2: "PDL wait", 3: "K/V write"} | {4 + i: f"tile {i}" for i in range(10)}
END = 14


def run(batch: int, context: int, kwargs: dict, contiguous: bool = False) -> dict:
    kv_cache, metadata, q, k_new, v_new, out = ba.decode_inputs(batch, context)
    if contiguous:  # each request's pages one after another (block ids 1, 2, ... in order)
        table = metadata.block_table
        table.copy_(torch.arange(1, table.numel() + 1, dtype=table.dtype, device=table.device).view_as(table))
        metadata.slot_mapping.copy_(table[:, -1].long() * ba.BLOCK_SIZE + ba.BLOCK_SIZE - 1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = kwargs.pop("num_splits", decode_num_splits(batch, ba.NUM_KV_HEADS, num_sms))
    programs = batch * ba.NUM_KV_HEADS * splits
    kv_bytes = 2 * batch * context * ba.NUM_KV_HEADS * ba.HEAD_DIM * 2
    caches = [kv_cache] + [kv_cache.clone() for _ in range(ba.kv_copies(kv_bytes) - 1)]
    lines = torch.zeros(8, programs, 32, dtype=torch.int64, device="cuda")

    def call(cache, i, stamped=True):
        cache = ba.head_major_view(cache) if kwargs.get("head_major") else cache
        split_kv_decode(q, k_new, v_new, cache, metadata, ba.HEAD_DIM**-0.5, out, splits,
                        timeline=lines[i] if stamped else None, **kwargs)  # fmt: skip

    plain_us = ba.graph_time_ms(lambda: call(kv_cache, 0, False)) * 1e3
    stamped_us = ba.graph_time_ms(lambda: call(kv_cache, 0)) * 1e3
    replay = lines[0].clone()
    b2b_us = ba.back_to_back_ms(lambda c: call(c, next(i for i, x in enumerate(caches) if x is c)), caches) * 1e3
    b2b = lines[: len(caches)].clone()
    return {"batch": batch, "context": context, "splits": splits, "plain_us": plain_us, "stamped_us": stamped_us,
            "b2b_us": b2b_us, "replay": replay.cpu(), "b2b": b2b.cpu()}  # fmt: skip


def describe(t: torch.Tensor, origin: int, label: str) -> None:
    """Percentiles over the programs of each point's time (µs from `origin`), then of each program's span."""
    stamp = t[:, 0::2][:, :16]
    print(f"  {label}: µs from the first program's start, over {t.shape[0]} programs: min / p10 / median / p90 / max")
    for point, name in {**POINTS, END: "end"}.items():
        col = stamp[:, point]
        if (col == 0).all():
            continue
        us = (col[col > 0] - origin).double() / 1e3
        qs = torch.quantile(us, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
        print(f"    {name:>10} " + " ".join(f"{v:7.2f}" for v in qs))
    span = (stamp[:, END] - stamp[:, 0]).double() / 1e3
    cycles = (t[:, 2 * END + 1] - t[:, 1]).double()
    print(f"    program span µs: median {span.median():.2f}, max {span.max():.2f}; SM clock from the spans: "
          f"{(cycles / span / 1e3).median():.2f} GHz")  # fmt: skip
    sms = t[:, 31]
    counts = torch.bincount(sms.long())
    hist = torch.bincount(counts[counts > 0])
    print("    SMs by programs on them: " + ", ".join(f"{int(v)} with {n}" for n, v in enumerate(hist) if v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x256,64x2048")
    p.add_argument("--configs", default="", help="launch configs as bench_attention.py's --config-sweep takes them "
                   "(default: the kernel's own)")
    p.add_argument("--contiguous", action="store_true", help="also with each request's pages in order")
    p.add_argument("--raw", help="torch.save the stamps here")
    args = p.parse_args()
    pin_triton_setup()
    results = []
    runs = [(s, c, False) for s in args.shapes.split(",") for c in args.configs.split(",")]
    runs += [(s, c, True) for s, c, _ in runs] if args.contiguous else []
    for shape, config, contiguous in runs:
        batch, context = (int(v) for v in shape.split("x"))
        r = run(batch, context, ba.parse_config(config) if config else {}, contiguous)
        results.append(r)
        pages = "pages in order" if contiguous else "random pages"
        print(f"\n{batch} x {context} {config or 'default'}, {pages} ({r['splits']} split): {r['plain_us']:.1f} µs "
              f"a replay, {r['stamped_us']:.1f} stamped, {r['b2b_us']:.1f} back to back (stamped)")  # fmt: skip
        replay = r["replay"]
        describe(replay, int(replay[:, 0].min()), "a replay")
        b2b = r["b2b"]
        first = int(b2b[0, :, 0].min())
        print("  back to back: each call's first start, last start, last end (µs from the first call's start)")
        for i, t in enumerate(b2b):
            print(f"    call {i}: {(t[:, 0].min() - first) / 1e3:7.2f} {(t[:, 0].max() - first) / 1e3:7.2f} "
                  f"{(t[:, 2 * END].max() - first) / 1e3:7.2f}")  # fmt: skip
        mid = b2b[len(b2b) // 2]
        describe(mid, int(mid[:, 0].min()), f"back to back, call {len(b2b) // 2}")
    if args.raw:
        torch.save(results, args.raw)


if __name__ == "__main__":
    main()
