"""Where a decode kernel's time goes, program by program: each program of the decode kernel stamps the GPU's global
timer (and its SM's cycle counter) at its start, once its metadata has arrived, past the PDL wait, past the K/V
write's barrier, after each key tile, at its end and, the last split of each (request, kv head), once it has merged
the splits (`split_kv_decode(timeline=...)`), under a CUDA graph as `bench_attention.py` times it: a replay of one
call, and eight calls back to back over copies of the K/V. Per point, percentiles over the programs; then how fast the
key tiles completed over time (their K/V bytes a µs: the rate the kernel consumed data at) and how many programs were
still running.

    python scripts/dev/decode_timeline.py [--shapes 64x256,64x2048] [--configs ,32x2x3] [--contiguous] [--raw out.pt]
"""

from __future__ import annotations

import argparse

import bench_attention as ba
import torch

from kiln.backends.attention import triton_decode as td
from kiln.compile import pin_triton_setup

TILES, COLUMNS = td.TIMELINE_TILES.value, td.TIMELINE_COLUMNS.value
END = 4 + TILES
POINTS = {0: "start", 1: "metadata", 2: "PDL wait", 3: "K/V write"} | {4 + i: f"tile {i}" for i in range(TILES)}
POINTS[END] = "end"


def run(batch: int, context: int, kwargs: dict, contiguous: bool = False) -> dict:
    kv_cache, metadata, q, k_new, v_new, out = ba.decode_inputs(batch, context)
    if contiguous:  # each request's pages one after another (block ids 1, 2, ... in order)
        table = metadata.block_table
        table.copy_(torch.arange(1, table.numel() + 1, dtype=table.dtype, device=table.device).view_as(table))
        metadata.slot_mapping.copy_(table[:, -1].long() * ba.BLOCK_SIZE + ba.BLOCK_SIZE - 1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = kwargs.pop("num_splits", td.decode_splits(batch, ba.NUM_HEADS, ba.NUM_KV_HEADS, ba.HEAD_DIM, num_sms))
    programs = batch * ba.NUM_KV_HEADS * splits
    kv_bytes = 2 * batch * context * ba.NUM_KV_HEADS * ba.HEAD_DIM * 2
    caches = [kv_cache] + [kv_cache.clone() for _ in range(ba.kv_copies(kv_bytes) - 1)]
    lines = torch.zeros(len(caches), programs, COLUMNS, dtype=torch.int64, device="cuda")

    def call(cache, i, stamped=True):
        td.split_kv_decode(q, k_new, v_new, cache, metadata, ba.HEAD_DIM**-0.5, out, splits,
                        timeline=lines[i] if stamped else None, **kwargs)  # fmt: skip

    plain_us = ba.graph_time_ms(lambda: call(kv_cache, 0, False)) * 1e3
    stamped_us = ba.graph_time_ms(lambda: call(kv_cache, 0)) * 1e3
    replay = lines[0].clone()
    b2b_us = ba.back_to_back_ms(lambda c: call(c, next(i for i, x in enumerate(caches) if x is c)), caches) * 1e3
    tile_n = (kwargs.get("config") or td.decode_config(programs, batch))[0]
    return {"batch": batch, "context": context, "splits": splits, "plain_us": plain_us, "stamped_us": stamped_us,
            "b2b_us": b2b_us, "replay": replay.cpu(), "b2b": lines.cpu(),
            "tile_bytes": 2 * tile_n * ba.HEAD_DIM * 2}  # fmt: skip


def percentiles(us: torch.Tensor) -> str:
    """min / p10 / median / p90 / max of `us`, formatted."""
    qs = torch.quantile(us, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
    return " ".join(f"{v:7.2f}" for v in qs)


def describe(t: torch.Tensor, label: str, tile_bytes: int) -> None:
    """Percentiles over the programs of each point's time (µs from the first program's start), the key tiles'
    bytes completed a µs, the programs running, and the SMs' loads."""
    stamp = t[:, 0 : 2 * (END + 1) : 2]
    origin = int(stamp[:, 0].min())
    print(f"  {label}: µs from the first program's start, over {t.shape[0]} programs: min / p10 / median / p90 / max")
    for point, name in POINTS.items():
        col = stamp[:, point]
        if (col == 0).all():
            continue
        print(f"    {name:>10} " + percentiles((col[col > 0] - origin).double() / 1e3))
    # the last split of each (request, kv head), once it has merged the partials; the last to arrive can change from
    # one replay to the next, and the buffer keeps an earlier replay's stamps (before this one's start): left out
    merged = t[:, td.TIMELINE_MERGED.value]
    if (merged >= origin).any():
        print(f"    {'merged':>10} " + percentiles((merged[merged >= origin] - origin).double() / 1e3))
    span = (stamp[:, END] - stamp[:, 0]).double() / 1e3
    cycles = (t[:, 2 * END + 1] - t[:, 1]).double()
    print(f"    program span µs: median {span.median():.2f}, max {span.max():.2f}; SM clock from the spans: "
          f"{(cycles / span / 1e3).median():.2f} GHz")  # fmt: skip
    done = stamp[:, 4:END]
    done = (done[done > 0] - origin).double() / 1e3
    last = int(((stamp[:, END] - origin) / 1e3).max()) + 1
    rate = torch.histc(done, bins=last, min=0, max=last) * tile_bytes / 1e6  # MB a µs = TB/s
    print("    key tiles done, TB/s by µs: " + " ".join(f"{v:.1f}" for v in rate.tolist()))
    running = [int(((stamp[:, 0] - origin) <= x * 1e3).logical_and((stamp[:, END] - origin) > x * 1e3).sum())
               for x in range(last)]  # fmt: skip
    print("    programs running by µs: " + " ".join(str(v) for v in running))
    counts = torch.bincount(t[:, COLUMNS - 1])
    hist = torch.bincount(counts[counts > 0])
    print("    SMs by programs on them: " + ", ".join(f"{int(v)} with {n}" for n, v in enumerate(hist) if v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x256,64x2048")
    p.add_argument("--configs", default="", help="launch configs as bench_attention.py's --config-sweep takes them; "
                   "an empty one is the kernel's own (default)")  # fmt: skip
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
        describe(r["replay"], "a replay", r["tile_bytes"])
        b2b = r["b2b"]
        first = int(b2b[0, :, 0].min())
        print("  back to back: each call's first start, last start, last end (µs from the first call's start)")
        for i, t in enumerate(b2b):
            print(f"    call {i}: {(t[:, 0].min() - first) / 1e3:7.2f} {(t[:, 0].max() - first) / 1e3:7.2f} "
                  f"{(t[:, 2 * END].max() - first) / 1e3:7.2f}")  # fmt: skip
        describe(b2b[len(b2b) // 2], f"back to back, call {len(b2b) // 2}", r["tile_bytes"])
    if args.raw:
        torch.save(results, args.raw)


if __name__ == "__main__":
    main()
