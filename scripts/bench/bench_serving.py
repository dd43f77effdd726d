"""HTTP load generator for `kiln serve`: Poisson arrivals at a rate, or a fixed concurrency; streams
every request and reports TTFT, time per output token, inter-token latency (p50, p99) and output
tokens/s. With `--offline-model`, also runs the same requests through `LLM.generate` in this process
and prints HTTP throughput as a share of offline throughput.

    kiln serve llama-3.2-1b --port 8000 &
    python scripts/bench/bench_serving.py --url http://127.0.0.1:8000 --num-requests 512 --concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time

import aiohttp

_NONEMPTY_TEXT = re.compile(rb'"text": ?"(?!")')


def make_requests(num: int, input_len: int, output_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randint(10, vocab - 1) for _ in range(input_len)], output_len) for _ in range(num)]


async def one_request(session, url, model, prompt, max_tokens, api_key, results) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            results.append({"error": resp.status})
            return
        # NOTE: a bytes check, not json.loads per event: at tens of thousands of events a second this one
        # client process must not be what limits the figure. An event counts if its text is not empty.
        async for raw in resp.content:
            if raw.startswith(b"data: {") and _NONEMPTY_TEXT.search(raw):
                times.append(time.perf_counter())
    end = time.perf_counter()
    results.append(
        {
            "ttft": times[0] - start if times else end - start,
            "e2e": end - start,
            "tokens": max_tokens,
            "itl": [b - a for a, b in zip(times, times[1:])],
        }
    )


async def run_load(args, requests) -> tuple[list[dict], float]:
    results: list[dict] = []
    limit = asyncio.Semaphore(args.concurrency)
    rng = random.Random(1)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def limited(prompt, max_tokens):
            async with limit:
                await one_request(session, args.url, args.model, prompt, max_tokens, args.api_key, results)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.rate > 0:
                await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def process_cpu_seconds(pid: int | None) -> tuple[float, ...]:
    """(the process's CPU seconds, its children's summed): the API server and its engine core."""
    if pid is None:
        return ()

    def cpu(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return cpu(pid), sum(cpu(c) for c in children)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--offline-model", default=None, help="also run the requests offline with LLM(this model)")
    p.add_argument("--offline-only", action="store_true", help="skip HTTP (run after the server is stopped)")
    p.add_argument("--tokenizer", default=None, help="the offline run's tokenizer directory (give it the server's)")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="the API server's pid: report its CPU share and its engine core's while loaded",
    )
    p.add_argument("--json")
    args = p.parse_args()
    if args.model is None and not args.offline_only:
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(f"{args.url}/v1/models") as r:
            args.model = json.load(r)["data"][0]["id"]
    requests = make_requests(args.num_requests, args.input_len, args.output_len, args.vocab)
    cpu_before = process_cpu_seconds(args.server_pid)
    results, elapsed = asyncio.run(run_load(args, requests)) if not args.offline_only else ([], float("nan"))
    cpu_after = process_cpu_seconds(args.server_pid)
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok) if not args.offline_only else sum(n for _, n in requests)
    tpot = [(r["e2e"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    summary = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in ok], 0.5),
        "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok], 0.99),
        "tpot_p50_ms": 1e3 * pct(tpot, 0.5),
        "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
        "itl_p50_ms": 1e3 * pct(itl, 0.5),
        "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "mean_e2e_s": statistics.fmean(r["e2e"] for r in ok) if ok else float("nan"),
    }
    # A share near 1.0 means that process (one Python thread doing most of the work) limits the run.
    for name, before, after in zip(("api_server_cpu_share", "engine_core_cpu_share"), cpu_before, cpu_after):
        summary[name] = (after - before) / elapsed
    if args.offline_model:
        from kiln.engine import LLM, SamplingParams  # noqa: PLC0415

        llm = LLM(args.offline_model, tokenizer=args.tokenizer)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        start = time.perf_counter()
        llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
        summary["offline_tokens_per_s"] = tokens / (time.perf_counter() - start)
        if not args.offline_only:
            summary["http_share_of_offline"] = summary["output_tokens_per_s"] / summary["offline_tokens_per_s"]
    print(
        f"\nserving: {args.model} at {args.url}, {args.num_requests} requests, input {args.input_len}, "
        f"output {args.output_len}, rate {args.rate or 'inf'}/s, concurrency {args.concurrency}"
    )
    for key, value in summary.items():
        print(f"  {key:<24} {value:>12.2f}" if isinstance(value, float) else f"  {key:<24} {value:>12}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"model": args.model, **vars(args), **summary}) + "\n")


if __name__ == "__main__":
    main()
