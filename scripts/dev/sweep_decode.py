"""The decode kernel alone (it writes the new K/V too) at other split counts, smallest split sizes and launch configs
than the backend chooses, at `scripts/bench/bench_attention.py`'s points: what the split heuristic and the launch
configs in `kiln.backends.attention.triton_decode` were chosen from. GPU; each point a CUDA-graph replay and eight
calls back to back over copies of the K/V.

    python scripts/dev/sweep_decode.py --splits 1,2,4,8,16,32,64 [--min-split 64,128] [--configs 64x2x3,128x4x2s32]
        [--shapes 64x256,1x8192] [--model qwen2.5-7b] [--full-layers] [--kv-cache-dtype fp8]

A config is TILExWARPSxSTAGES, then sN (N splits at any context, the one-split cut-off off) and mN (splits of N
tokens or more).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_attention as ba  # noqa: E402

from kiln.backends.attention import get_attention_backend  # noqa: E402
from kiln.backends.attention.decode_plan import decode_splits  # noqa: E402
from kiln.backends.attention.triton_decode import split_kv_decode  # noqa: E402
from kiln.compile import pin_triton_setup  # noqa: E402
from kiln.engine.models.presets import PRESETS  # noqa: E402


def parse_config(name: str) -> dict:
    """TILExWARPSxSTAGES[sN][mN] -> split_kv_decode's keywords."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:s(\d+))?(?:m(\d+))?", name)
    if not m:
        raise SystemExit(f"bad launch config {name!r}: TILExWARPSxSTAGES[sN][mN], e.g. 64x2x3, 64x2x2s2m128")
    kwargs = {"config": (int(m[1]), int(m[2]), int(m[3]))}
    if m[4]:
        kwargs.update(num_splits=int(m[4]), unsplit_tokens=0)
    if m[5]:
        kwargs.update(min_split_tokens=int(m[5]))
    return kwargs


def sweep(
    batch: int,
    context: int,
    num_sms: int,
    splits: list[int],
    min_tokens: list[int],
    configs: dict[str, dict],
    kv_dtype: torch.dtype,
) -> dict:
    kv_cache, metadata, q, k_new, v_new, out = ba.decode_inputs(batch, context, kv_dtype)
    kv_bytes = 2 * batch * context * ba.NUM_KV_HEADS * ba.HEAD_DIM * kv_dtype.itemsize
    caches = [kv_cache] + [kv_cache.clone() for _ in range(ba.kv_copies(kv_bytes) - 1)]
    chosen = decode_splits(batch, ba.NUM_HEADS, ba.NUM_KV_HEADS, ba.HEAD_DIM, num_sms)
    scale = ba.HEAD_DIM**-0.5

    def timed(**kwargs) -> tuple[float, float]:
        decode = lambda cache: split_kv_decode(q, k_new, v_new, cache, metadata, scale, out, **kwargs)  # noqa: E731
        try:
            times = ba.graph_time_ms(lambda: decode(kv_cache)) * 1e3, ba.back_to_back_ms(decode, caches) * 1e3
        except Exception as e:  # e.g. a tile too big for shared memory
            first_line = str(e).partition("\n")[0][:200]
            print(f"{batch}x{context} {kwargs}: {type(e).__name__}: {first_line}", flush=True)
            return float("nan"), float("nan")
        # each point as it lands: a step cut by its time limit keeps what it measured
        print(f"{batch}x{context} {kwargs}: {times[0]:.1f} / {times[1]:.1f} us", flush=True)
        return times

    return {
        "batch": batch,
        "context": context,
        "chosen": chosen,
        "splits": {s: timed(num_splits=s) for s in splits},
        "min_split": {t: timed(num_splits=chosen, min_split_tokens=t) for t in min_tokens},
        "configs": {name: timed(**{"num_splits": chosen, **c}) for name, c in configs.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", default="", help="split counts, e.g. 1,2,4")
    p.add_argument("--min-split", default="", help="smallest split sizes (tokens) at the chosen count, e.g. 64,128")
    p.add_argument("--configs", default="", help="launch configs at the chosen count, e.g. 64x4x3,128x8x2s32")
    p.add_argument("--shapes", default="", help="BATCHxCONTEXT points (default: the benchmark's grid)")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 cache")
    p.add_argument("--full-layers", action="store_true", help="the model's full layers' shapes (Gemma 4's)")
    args = p.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    ba.use_model_shapes(args.model, args.full_layers)
    pin_triton_setup()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    shapes = shapes or [(b, c) for b in ba.DECODE_BATCHES for c in ba.DECODE_CONTEXTS if b * c <= 4 << 20]
    splits = [int(x) for x in args.splits.split(",") if x]
    min_tokens = [int(x) for x in args.min_split.split(",") if x]
    configs = {c: parse_config(c) for c in args.configs.split(",") if c}
    num_sms = get_attention_backend("triton").num_sms
    rows = [sweep(b, c, num_sms, splits, min_tokens, configs, kv_dtype) for b, c in shapes]
    device = torch.cuda.get_device_name()
    heads = f"{ba.NUM_HEADS} query heads, {ba.NUM_KV_HEADS} kv heads, head_dim {ba.HEAD_DIM}"
    what = f"{args.model} shapes ({heads}), {kv_dtype} cache, {device}"
    print(f"\ndecode kernel alone, {what}: us a replay / eight calls back to back")
    for key, what in (("splits", "splits"), ("min_split", ">= tokens"), ("configs", "config")):
        names = list(rows[0][key]) if rows else []
        if names:
            print(f"{'batch':>5} {'context':>7} {'chosen':>6} " + " ".join(f"{f'{n} {what}':>17}" for n in names))
            for r in rows:
                cells = " ".join(f"{r[key][n][0]:>8.1f}/{r[key][n][1]:<8.1f}" for n in names)
                print(f"{r['batch']:>5} {r['context']:>7} {r['chosen']:>6} {cells}")


if __name__ == "__main__":
    main()
