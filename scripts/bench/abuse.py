"""Well-behaved clients' latency with abusive ones beside them, against a running `kiln serve`: the same steady load
twice, alone and then with slow readers, slow writers (a body a byte at a time, a head that never ends), grammar
bombs (schemas that are refused, or slow to parse and compile) and cancelled streams mixed in, and the second red
team's: schemas whose compiled grammars are large (bigschema) or slow to compile or parse (slowcompile, slowparse;
their clients give up after 4 s), prompt-logprob amplifiers (echo), readers of n=16 top-20 log-probability streams at
~20 KB/s (fatreader) and gzip bodies of 5 million token ids (ids). Prints the good clients' p50/p99 request latency
in each phase and their ratio (the goal: p99 within 2x), their errors (must be 0), the 5xx any client got (must be
0), and whether every KV block is back at the end.

    kiln serve MODEL --port 8000 &
    python scripts/bench/abuse.py --url http://127.0.0.1:8000 --seconds 30 --concurrency 8 --abusers 16

Each abuser acts at most once a second (--abuse-interval): what is measured is the harm of each kind of abuse,
not of volume, which per-key rate limits bound.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import json
import random
import statistics
import time
import urllib.request

import aiohttp


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def nested_schema(depth: int, width: int = 2) -> dict:
    """An object schema of `width` properties a level, `depth` levels: xgrammar's parse grows with its size."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema for i in range(width)}, "required": ["p0"]}
    return schema


class Phase:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.abuse = {"slow_reader": 0, "slow_writer": 0, "slow_head": 0, "grammar": 0, "cancelled": 0}
        self.server_errors: list[str] = []  # a 5xx any client got, the abusers' included

    def answered(self, kind: str, status: int) -> None:
        self.abuse[kind] = self.abuse.get(kind, 0) + 1
        if status >= 500:
            self.server_errors.append(f"{kind}: {status}")


async def good_client(session: aiohttp.ClientSession, args, phase: Phase, stop: float, rng: random.Random) -> None:
    while time.monotonic() < stop:
        body = {
            "prompt": " ".join(rng.choice(["the", "a", "cat", "sat", "on", "mat"]) for _ in range(32)),
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        start = time.monotonic()
        try:
            async with session.post(f"{args.url}/v1/completions", json=body, headers=args.headers) as r:
                if r.status != 200:
                    if r.status >= 500:
                        phase.server_errors.append(f"good: {r.status}")
                    phase.errors.append(f"{r.status}: {(await r.text())[:200]}")
                    continue
                async for line in r.content:
                    if line.startswith(b"data: ") and b'"error"' in line:
                        phase.errors.append(line.decode()[:200])
            phase.latencies.append(time.monotonic() - start)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            phase.errors.append(repr(e)[:200])


async def slow_reader(session, args, phase: Phase, stop: float) -> None:
    """A stream read a line a second: the server's write buffer fills, --stream-idle-timeout cuts it off."""
    body = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with session.post(f"{args.url}/v1/completions", json=body, headers=args.headers) as r:
        while time.monotonic() < stop and await r.content.readline():
            await asyncio.sleep(1.0)
    phase.abuse["slow_reader"] += 1


async def slow_writer(args, phase: Phase, head_only: bool) -> None:
    """A body (or a request head) sent a few bytes a second: the server's timeouts close the connection."""
    host, port = args.url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n"
        data = (head if head_only else head + "\r\n" + '{"prompt": "' + "a" * 400).encode()
        for i in range(0, len(data), 4):
            writer.write(data[i : i + 4])
            await writer.drain()
            await asyncio.sleep(0.5)
    except (ConnectionError, OSError):
        pass
    phase.abuse["slow_head" if head_only else "slow_writer"] += 1


async def grammar_bomb(session, args, phase: Phase, rng: random.Random) -> None:
    schema = rng.choice([nested_schema(40, 1), nested_schema(10, 2), {"not": {"type": "string"}}, nested_schema(6, 3)])
    body = {
        "messages": [{"role": "user", "content": "json"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    async with session.post(f"{args.url}/v1/chat/completions", json=body, headers=args.headers) as r:
        await r.read()
        phase.answered("grammar", r.status)


async def cancelled_stream(session, args, phase: Phase, rng: random.Random) -> None:
    body = {"prompt": "cancel me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with session.post(f"{args.url}/v1/completions", json=body, headers=args.headers) as r:
        for _ in range(rng.randint(1, 5)):
            await r.content.readline()
    phase.abuse["cancelled"] += 1


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


async def constrained(session, args, phase: Phase, kind: str, schema: dict, give_up_s: float | None = None) -> None:
    body = {"messages": [{"role": "user", "content": "json"}], "max_tokens": 8, "response_format": json_schema(schema)}
    timeout = aiohttp.ClientTimeout(total=give_up_s) if give_up_s else None
    try:
        async with session.post(
            f"{args.url}/v1/chat/completions", json=body, headers=args.headers, timeout=timeout
        ) as r:
            await r.read()
            phase.answered(kind, r.status)
    except asyncio.TimeoutError:
        phase.answered(kind, 0)  # gave up: the server stops its check or compile


@functools.cache
def ids_body() -> bytes:
    """Built once: a second of json.dumps and gzip would stall this client's own loop, the good clients' too."""
    return gzip.compress(json.dumps({"prompt": [1] * 5_000_000, "max_tokens": 1}).encode())


async def second_round(session, args, phase: Phase, kind: str, rng: random.Random) -> None:
    """The second red team's attacks (issue 60)."""
    tag = rng.randrange(10**9)  # a new schema each time: nothing cached helps
    if kind == "bigschema":  # 600 optional properties: a compiled grammar of ~118 MiB
        props = {f"p{tag}_{i}": {"type": "string"} for i in range(600)}
        await constrained(session, args, phase, kind, {"type": "object", "properties": props})
    elif kind == "slowcompile":  # parsed in ms, compiled (and written out) for 20 s or more
        item = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{3,9}$"}}
        props = {f"t{tag}_{i}": item for i in range(300)}
        await constrained(session, args, phase, kind, {"type": "object", "properties": props}, give_up_s=4)
    elif kind == "slowparse":  # 300 bytes that take a minute to parse
        props = {f"p{i}": {"type": "string", "maxLength": 8000 + tag % 1000 + i} for i in range(3)}
        await constrained(session, args, phase, kind, {"type": "object", "properties": props}, give_up_s=4)
    elif kind == "echo":  # 255 prompts x 400 tokens with echo and top-20: refused by --max-prompt-logprob-rows
        body = {"prompt": [[7] * 400] * 255, "max_tokens": 1, "echo": True, "logprobs": 20}
        async with session.post(f"{args.url}/v1/completions", json=body, headers=args.headers) as r:
            await r.read()
            phase.answered(kind, r.status)
    elif kind == "fatreader":  # n=16 with top-20 log-probabilities, read at ~20 KB/s for 10 s
        body = {"prompt": "slow", "max_tokens": 64, "ignore_eos": True, "stream": True, "n": 16, "logprobs": 20}
        async with session.post(f"{args.url}/v1/completions", json=body, headers=args.headers) as r:
            phase.answered(kind, r.status)
            until = time.monotonic() + 10
            while time.monotonic() < until and await r.content.read(2048):
                await asyncio.sleep(0.1)
    elif kind == "ids":  # 5 million token ids, ~15 KB gzipped
        raw = ids_body()
        headers = {**args.headers, "Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with session.post(f"{args.url}/v1/completions", data=raw, headers=headers) as r:
            await r.read()
            phase.answered(kind, r.status)


SECOND_ROUND = ("bigschema", "slowcompile", "slowparse", "echo", "fatreader", "ids")


async def abuser(session, args, phase: Phase, stop: float, rng: random.Random) -> None:
    """One abusive act after another, at most one each --abuse-interval seconds (the harm of each kind, not of
    sheer volume: that is what per-key rate limits are for)."""
    while time.monotonic() < stop:
        began = time.monotonic()
        kind = rng.choice(args.kinds)
        try:
            if kind == "reader":
                await slow_reader(session, args, phase, stop)
            elif kind in ("writer", "head"):
                await slow_writer(args, phase, kind == "head")
            elif kind == "grammar":
                await grammar_bomb(session, args, phase, rng)
            elif kind in SECOND_ROUND:
                await second_round(session, args, phase, kind, rng)
            else:
                await cancelled_stream(session, args, phase, rng)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(max(0.0, args.abuse_interval - (time.monotonic() - began)))


async def run_phase(args, abusers: int) -> Phase:
    phase = Phase()
    stop = time.monotonic() + args.seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [good_client(session, args, phase, stop, random.Random(i)) for i in range(args.concurrency)]
        tasks += [abuser(session, args, phase, stop, random.Random(100 + i)) for i in range(abusers)]
        await asyncio.gather(*tasks)
    return phase


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


async def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(url, "kiln_num_requests_running") == 0 and metric(url, "kiln_num_requests_waiting") == 0:
            return
        await asyncio.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=8, help="well-behaved clients, requests back to back")
    p.add_argument("--abusers", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--abuse-interval", type=float, default=1.0, help="seconds between one abuser's acts, at least")
    p.add_argument(
        "--kinds",
        default="reader,writer,head,grammar,grammar,cancel,cancel",
        help="the abusers' mix (reader, writer, head, grammar, cancel, " + ", ".join(SECOND_ROUND) + "; repeat one "
        "to weigh it)",
    )
    p.add_argument("--json", help="append the results as one JSON line to this file")
    args = p.parse_args()
    args.kinds = args.kinds.split(",")
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    free_before = metric(args.url, "kiln_kv_cache_free_blocks")
    alone = asyncio.run(run_phase(args, 0))
    asyncio.run(wait_idle(args.url))
    mixed = asyncio.run(run_phase(args, args.abusers))
    asyncio.run(wait_idle(args.url))
    time.sleep(2)  # the last stats from the engine
    free_after = metric(args.url, "kiln_kv_cache_free_blocks")
    rows = {"alone": alone, "with abusers": mixed}
    print(f"{'good clients':16}{'requests':>10}{'p50 s':>9}{'p99 s':>9}{'errors':>8}")
    for name, phase in rows.items():
        p50, p99 = percentile(phase.latencies, 50), percentile(phase.latencies, 99)
        print(f"{name:16}{len(phase.latencies):>10}{p50:>9.3f}{p99:>9.3f}{len(phase.errors):>8}")
    ratio = percentile(mixed.latencies, 99) / percentile(alone.latencies, 99)
    print(f"p99 ratio {ratio:.2f} (goal <= 2); abuse done: {mixed.abuse}")
    server_errors = alone.server_errors + mixed.server_errors
    print(f"5xx: {len(server_errors)} {server_errors[:5]}")
    back = "back" if free_after == free_before else "NOT back"
    print(f"KV free blocks {free_before:.0f} before, {free_after:.0f} after ({back})")
    for error in (alone.errors + mixed.errors)[:5]:
        print("error:", error)
    if args.json:
        row = {}
        for name, ph in rows.items():
            row[name] = dict(requests=len(ph.latencies), errors=len(ph.errors))
            row[name].update(p50=percentile(ph.latencies, 50), p99=percentile(ph.latencies, 99))
        row.update(p99_ratio=ratio, abuse=mixed.abuse, kv_free_before=free_before, kv_free_after=free_after)
        row.update(server_errors=len(server_errors))
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
