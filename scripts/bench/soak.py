"""A bounded soak of a running `kiln serve`: steady load near capacity with random cancellations for
a fixed time; reports requests served, errors (must be 0), server memory growth, and whether the KV
cache is back to its idle baseline afterwards.

    kiln serve llama-3.2-1b --port 8000 &
    python scripts/bench/soak.py --url http://127.0.0.1:8000 --minutes 10 --concurrency 200 --server-pid $!
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request

import aiohttp


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


async def worker(session, args, stats, deadline, rng) -> None:
    while time.monotonic() < deadline:
        body = {
            "prompt": [rng.randint(10, args.vocab - 1) for _ in range(rng.randint(16, args.max_input))],
            "max_tokens": rng.randint(8, args.max_output),
            "ignore_eos": True,
            "stream": True,
        }
        cancel_at = rng.randint(1, 20) if rng.random() < args.cancel_fraction else None
        try:
            async with session.post(f"{args.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    stats["errors"] += 1
                    continue
                events = 0
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if '"error"' in line:
                        stats["errors"] += 1
                    events += line.startswith("data: {")
                    if cancel_at is not None and events >= cancel_at:
                        stats["cancelled"] += 1
                        break
                else:
                    stats["served"] += 1
        except aiohttp.ClientError:
            stats["errors"] += 1


async def soak(args) -> dict:
    stats = {"served": 0, "cancelled": 0, "errors": 0}
    deadline = time.monotonic() + args.minutes * 60
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        await asyncio.gather(
            *(worker(session, args, stats, deadline, random.Random(i)) for i in range(args.concurrency))
        )
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=200, help="about 80% of measured capacity")
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--server-pid", type=int, default=None, help="to report memory growth (with its children)")
    p.add_argument("--json")
    args = p.parse_args()
    baseline_blocks = metric(args.url, "kiln_kv_cache_free_blocks")
    rss_before = rss_mib(args.server_pid)
    stats = asyncio.run(soak(args))
    deadline = time.time() + 60
    while time.time() < deadline and metric(args.url, "kiln_num_requests_running") > 0:
        time.sleep(0.5)
    result = {
        **stats,
        "rss_before_mib": rss_before,
        "rss_after_mib": rss_mib(args.server_pid),
        "kv_free_blocks_baseline": baseline_blocks,
        "kv_free_blocks_after": metric(args.url, "kiln_kv_cache_free_blocks"),
    }
    result["kv_back_to_baseline"] = result["kv_free_blocks_after"] == baseline_blocks
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
