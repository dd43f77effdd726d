"""Where a decode step's GPU time goes, kernel by kernel (torch.profiler), for one model and batch:

python scripts/dev/profile_step.py --model llama-3.2-1b --batch 1 --top 25
python scripts/dev/profile_step.py --model llama-3.2-1b --batch 64 --prompt-len 8192 --kv-cache-dtype fp8
python scripts/dev/profile_step.py --model llama-3.1-8b --batch 1 --drafts 4 --host   # a step verifying 4 drafts

The step's wall time is printed beside its GPU time: the difference is the host's share (launches, syncs, scheduling).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_latency import weight_bytes_read  # noqa: E402
from bench_spec import BlindDrafter  # noqa: E402

from kiln.engine import LLM, SamplingParams


def profile_host(llm: LLM, args) -> None:
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    prompts = [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    timing = llm.engine.step_timing
    print(f"\nhost profile of LLM.generate, batch {args.batch}, {args.steps} steps; engine timing so far: {timing}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32, help="each request's prompt: the context decode reads")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--host", action="store_true", help="then cProfile the host side of LLM.generate")
    p.add_argument("--drafts", type=int, default=0, help="every step verifies this many (blind) drafts a request")
    args = p.parse_args()
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=max(2048, args.prompt_len + (1 + args.drafts) * 8 * args.steps),
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(args.batch, 8),
        gpu_memory_utilization=0.8,
        enforce_eager=args.enforce_eager,
        cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
        speculative_config={"method": "ngram", "num_speculative_tokens": args.drafts} if args.drafts else None,
    )
    engine = llm.engine
    if args.drafts:
        engine.scheduler.drafter = BlindDrafter(args.drafts, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=(1 + args.drafts) * 4 * args.steps, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"profile-{i}", [(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)], params)
    # the prompts' prefill steps (max_num_batched_tokens a step), then a few decode steps
    for _ in range(8 + args.batch * args.prompt_len // engine.config.max_num_batched_tokens):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    weights = weight_bytes_read(engine.executor.model, args.batch)
    print(
        f"\n{args.model} batch {args.batch}, {args.drafts} drafts a request: wall time per step {wall:.1f} us, "
        f"GPU time per step {total / args.steps:.1f} us "
        f"(weights {weights / 1e9:.2f} GB: {weights / 4.3e12 * 1e6:.0f} us at 4.3 TB/s), "
        f"{sum(e.count for e in events) / args.steps:.0f} kernels per step"
    )
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    if engine.executor.shard.size > 1:
        print(
            f"NCCL (all-reduce / all-gather) on rank 0: {nccl / args.steps:.1f} us per step ({nccl / total:.1%}), "
            "waiting for the other ranks included"
        )
    print(f"{'us/step':>8} {'share':>6} {'calls/step':>10}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(
            f"{e.self_device_time_total / args.steps:8.1f} {e.self_device_time_total / total:6.1%} "
            f"{e.count / args.steps:10.1f}  {e.key[:110]}"
        )
    if args.host:
        engine.abort_requests([f"profile-{i}" for i in range(args.batch)])
        while engine.has_unfinished_requests():  # the step in flight
            engine.step()
        profile_host(llm, args)


if __name__ == "__main__":
    main()
