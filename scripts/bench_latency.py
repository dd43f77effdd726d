"""Decode latency: tokens/s and memory-bandwidth use at batch 1, 8, 64, in eager, compiled, and
compiled + CUDA graphs modes, with Hugging Face `generate()` (static cache + compile) as the peer.

Bandwidth use = (weight bytes + KV bytes read per step) / step time / 4.3 TB/s.

    python scripts/bench_latency.py --model llama-3.2-1b --modes eager,compiled,graphs --batches 1,8,64 --hf
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kiln.engine import LLM, SamplingParams
from kiln.engine.model_source import resolve_model

PEAK_BYTES_PER_S = 4.3e12
PROMPT_LEN, DECODE_STEPS = 32, 128

MODES = {
    "eager": dict(enforce_eager=True),
    "compiled": dict(cudagraph_mode="none"),
    "graphs": dict(cudagraph_mode="full_and_piecewise"),
}


def step_bytes(llm: LLM, batch: int) -> float:
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    c = llm.engine.model_config
    avg_context = PROMPT_LEN + DECODE_STEPS / 2
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * llm.engine.dtype.itemsize * avg_context * batch
    return weights + kv


def decode_tokens_per_s(llm: LLM, batch: int) -> tuple[float, float]:
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)] for i in range(batch)]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(4)  # warm-up
    step = (timed(DECODE_STEPS + 1) - timed(1)) / DECODE_STEPS  # prefill cancels out
    return batch / step, step_bytes(llm, batch) / step / PEAK_BYTES_PER_S


def hf_tokens_per_s(model_name: str, batch: int) -> float:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_config(resolve_model(model_name).hf_config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(1, 1000, (batch, PROMPT_LEN), device="cuda")

    def timed(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           cache_implementation="static", pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(DECODE_STEPS + 1)  # warm-up: compiles the decode step
    return batch * DECODE_STEPS / (timed(DECODE_STEPS + 1) - timed(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--modes", default="eager,compiled,graphs")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--capture-sizes", default=None, help="comma-separated; default: the engine's")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate()")
    p.add_argument("--hf-batches", default="1", help="batches at which to time Hugging Face")
    p.add_argument("--json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sizes = tuple(int(s) for s in args.capture_sizes.split(",")) if args.capture_sizes else None
    rows = []
    for mode in args.modes.split(","):
        kwargs = dict(MODES[mode], max_model_len=2048, max_num_seqs=max(batches), gpu_memory_utilization=0.8)
        if mode == "graphs" and sizes:
            kwargs["cudagraph_capture_sizes"] = sizes
        llm = LLM(args.model, **kwargs)
        for batch in batches:
            tps, util = decode_tokens_per_s(llm, batch)
            rows.append({"engine": f"kiln {mode}", "batch": batch, "tokens_per_s": tps, "bw_util": util,
                         "startup_s": llm.engine.startup_seconds})  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    if args.hf:
        for batch in (int(b) for b in args.hf_batches.split(",")):
            tps = hf_tokens_per_s(args.model, batch)
            rows.append({"engine": "hf static+compile", "batch": batch, "tokens_per_s": tps,
                         "bw_util": float("nan"), "startup_s": float("nan")})  # fmt: skip
    print(f"\ndecode latency: {args.model}, bf16, dummy weights, prompt {PROMPT_LEN}, {DECODE_STEPS} steps, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    print(f"{'engine':<20} {'batch':>5} {'tokens/s':>10} {'BW util':>8} {'startup s':>10}")
    for r in rows:
        print(f"{r['engine']:<20} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['bw_util']:>8.0%} "
              f"{r['startup_s']:>10.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
