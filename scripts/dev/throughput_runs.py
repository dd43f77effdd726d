"""Repeated offline-throughput runs in one process, to tell a build's speed from a process's luck.

bench_throughput.py's workload (nano-vllm's: 256 requests, prompts and outputs of 100-1,024 tokens), run
`--repeats` times through one engine; each repeat draws new prompts (the same prompts again would hit the prefix
cache). One JSON line a repeat: tok/s, steps, host and waiting-for-the-GPU seconds. Options:

    --kernels      one more repeat under torch.profiler: GPU kernel time by name, and the GPU's busy time (the union
                   of kernel intervals) against the span, so two builds' GPU work can be compared kernel by kernel
    --step-times   the first repeat's slowest steps (ms, tokens, requests): a one-off stall shows here
    --gc-freeze    gc.collect() then gc.freeze() once the engine is up, as an `LLM` does itself since c544fa7: for
                   A/Bs against older builds (each row counts the run's collections and their time)
    --cprofile F   the first repeat under cProfile, its top functions into F

A/B of two source trees in one device call (a worktree of the other commit; a fresh cache folder gives a cold start,
the same one again a warm start):

    git worktree add /tmp/old <commit> && mkdir -p /tmp/p_old && ln -s /tmp/old /tmp/p_old/kiln
    PYTHONPATH=/tmp/p_old KILN_CACHE_DIR=/tmp/c_old python scripts/dev/throughput_runs.py --tag old --repeats 3
    KILN_CACHE_DIR=/tmp/c_new python scripts/dev/throughput_runs.py --tag new --repeats 3
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import time

import torch

from kiln.compile.counters import TRITON_EVENTS
from kiln.engine import LLM, SamplingParams


def workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, min(vocab, 10000) - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)
    ]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_totals(prof) -> dict:
    """GPU kernel time by name (top 30) and the GPU's busy time: the union of the kernels' intervals."""
    device = torch.autograd.DeviceType.CUDA
    intervals, by_name = [], {}
    for e in prof.events():
        if e.device_type == device:
            intervals.append((e.time_range.start, e.time_range.end))
            n, us = by_name.get(e.name[:80], (0, 0.0))
            by_name[e.name[:80]] = (n + 1, us + e.time_range.elapsed_us())
    intervals.sort()
    busy, start, end = 0.0, None, None
    for s, e in intervals:
        if end is None or s > end:
            busy += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += 0.0 if end is None else end - start
    span = intervals[-1][1] - intervals[0][0] if intervals else 0
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {
        "gpu_busy_s": round(busy / 1e6, 3),
        "gpu_span_s": round(span / 1e6, 3),
        "kernels": len(intervals),
        "top": [[name, n, round(us / 1e3, 1)] for name, (n, us) in top],
    }


def watch_steps(llm: LLM, steps: list) -> None:
    """Record each engine step's wall time with its batch's tokens and requests into `steps`."""
    engine, inner_step, inner_schedule = llm.engine, llm.engine.step, llm.engine.scheduler.schedule
    last: dict = {}

    def schedule():
        batch = inner_schedule()
        last["batch"] = (batch.total_num_tokens, len(batch.requests))
        return batch

    def step(*args, **kwargs):
        start = time.perf_counter()
        last.clear()
        out = inner_step(*args, **kwargs)
        steps.append((time.perf_counter() - start, *last.get("batch", (None, None))))
        return out

    engine.step, engine.scheduler.schedule = step, schedule


def watch_gc() -> tuple[dict, object]:
    """Each garbage collection's time by generation, into the returned dict, until the callback is removed."""
    times: dict = {}
    started: list = []

    def callback(phase, info):
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            times.setdefault(info["generation"], []).append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    return times, callback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default="run", help="a name for this process's lines")
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--step-times", action="store_true")
    p.add_argument("--cprofile")
    p.add_argument("--gc-freeze", action="store_true")
    args = p.parse_args()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_num_seqs=256,
        max_model_len=4096,
        enforce_eager=args.enforce_eager,
        cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    )
    base = {"tag": args.tag, "startup_s": round(time.perf_counter() - start, 1), "kv_blocks": llm.engine.num_kv_blocks}
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    sync()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    vocab = llm.engine.model_config.vocab_size
    for seed in range(args.repeats + args.kernels):
        profiled = args.kernels and seed == args.repeats
        prompts, output_lens = workload(args.num_seqs, 100, args.max_len, vocab, seed)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        steps: list = []
        if args.step_times and seed == 0:
            watch_steps(llm, steps)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profiled else None
        cprof = cProfile.Profile() if args.cprofile and seed == 0 else None
        compiles = dict(TRITON_EVENTS)
        llm.engine.step_timing = type(llm.engine.step_timing)()
        if prof is not None:
            prof.__enter__()
        if cprof is not None:
            cprof.enable()
        collections, callback = watch_gc()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        elapsed = time.perf_counter() - start
        gc.callbacks.remove(callback)
        if cprof is not None:
            cprof.disable()
            text = io.StringIO()
            stats = pstats.Stats(cprof, stream=text)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(60)
            with open(args.cprofile, "w") as f:
                f.write(text.getvalue())
        if prof is not None:
            prof.__exit__(None, None, None)
        llm.engine.__dict__.pop("step", None)
        llm.engine.scheduler.__dict__.pop("schedule", None)
        t = llm.engine.step_timing
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        row = dict(base, seed=seed, profiled=profiled, tok_s=round(num_out / elapsed), seconds=round(elapsed, 3))
        row.update(steps=t.steps, host_s=round(t.host_seconds, 3), wait_s=round(t.wait_seconds, 3))
        row["triton_compiles"] = TRITON_EVENTS["compiles"] - compiles["compiles"]
        # kernels loaded mid-run (an older tree's counters may not count them)
        row["triton_cache_hits"] = TRITON_EVENTS.get("cache_hits", 0) - compiles.get("cache_hits", 0)
        # per generation: collections, their total and longest ms
        row["gc"] = {
            g: [len(t), round(sum(t) * 1e3, 1), round(max(t) * 1e3, 1)] for g, t in sorted(collections.items())
        }
        if steps:
            slowest = sorted(range(len(steps)), key=lambda j: -steps[j][0])[:12]
            row["slowest_steps"] = [[j, round(steps[j][0] * 1e3, 2), steps[j][1], steps[j][2]] for j in slowest]
        if prof is not None:
            row.update(kernel_totals(prof))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
