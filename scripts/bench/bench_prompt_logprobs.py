"""What prompt log-probabilities cost: one long prompt scored (`prompt_logprobs`, as an `echo` + `logprobs`
request asks) against the same prompt plain, alone and beside a batch of decoding requests.

    python scripts/bench/bench_prompt_logprobs.py --model llama-3.1-8b --prompt-len 4096

1. Latency: the prompt alone, max_tokens 1, with prompt_logprobs 1 and without (median of --repeats).
2. In a batch: --decoders requests decode while the long prompt arrives; the decoders' step time in the steps that
   hold the long prompt's prefill, and in the steps after it, with and without its prompt_logprobs. The extra work
   is the LM head and a log-softmax over every prompt position: 2 x prompt x hidden x vocab FLOPs, and the logits
   written and read once in float32 (prompt x vocab x 4 bytes x 2), in slices of 256 rows.

With --url (a running `kiln serve MODEL --no-enable-prefix-caching`), the same prompt over HTTP instead: a plain
completion against one with `echo: true, logprobs: 1` (lm-eval's log-likelihood request), max_tokens 1, the whole
round trip with the JSON of every prompt token's entry.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request

import torch

from kiln.engine import LLM, SamplingParams

PEAK_FLOPS, PEAK_BYTES_PER_S = 989e12, 4.3e12  # H200 dense bf16, measured copy bandwidth


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def latency(llm: LLM, prompt: list[int], k: int | None, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def http_latency(url: str, model: str, prompt: list[int], echo: bool, repeats: int) -> tuple[float, int]:
    """Median seconds of a completion request over HTTP, and its response's size in bytes."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if echo:
        body.update(echo=True, logprobs=1)
    data = json.dumps(body).encode()
    times, size = [], 0
    for _ in range(repeats):
        request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            size = len(response.read())
        times.append(time.perf_counter() - start)
    return statistics.median(times), size


def main_http(args: argparse.Namespace) -> None:
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    rng = random.Random(0)
    prompt = [rng.randrange(10, 30000) for _ in range(args.prompt_len)]
    http_latency(args.url, model, prompt[:64], True, 1)  # warm-up
    (plain, plain_size), (scored, scored_size) = (
        http_latency(args.url, model, prompt, echo, args.repeats) for echo in (False, True)
    )
    print(f"prompt logprobs over HTTP: {model}, a {args.prompt_len}-token prompt, {args.url}")
    print(f"{'':38}{'plain':>10}{'echo+logprobs':>17}")
    print(f"{'latency, alone (ms)':38}{plain * 1e3:10.1f}{scored * 1e3:17.1f}")
    print(f"{'response (kB)':38}{plain_size / 1e3:10.1f}{scored_size / 1e3:17.1f}")
    if args.json:
        row = dict(model=model, prompt_len=args.prompt_len, http=True, plain_s=plain, scored_s=scored)
        with open(args.json, "a") as f:
            f.write(json.dumps(row | dict(plain_bytes=plain_size, scored_bytes=scored_size)) + "\n")


def in_batch(llm: LLM, prompt: list[int], k: int | None, decoders: int, rng: random.Random) -> dict[str, float]:
    """Step times while `decoders` requests decode and the long prompt comes in (its prefill steps, then after)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    top = min(engine.model_config.vocab_size, 1000)
    for i in range(decoders):
        engine.add_request(f"d{i}-{rng.random()}", [rng.randrange(10, top) for _ in range(32)], params)
    for _ in range(8):  # the decoders' prefills, then plain decode steps
        engine.step()
    engine.add_request(f"long-{rng.random()}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=k))
    prefill, after = [], []
    while engine.has_unfinished_requests():
        sync()
        start = time.perf_counter()
        long_in_step = any(r.request_id.startswith("long") for r in engine.scheduler.running) or any(
            r.request_id.startswith("long") for r in engine.scheduler.waiting
        )
        engine.step()
        sync()
        (prefill if long_in_step else after).append(time.perf_counter() - start)
    return {"prefill_steps_ms": sum(prefill) * 1e3, "decode_step_ms": statistics.median(after) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--decoders", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--url", help="a running server's address (http://host:port): measure over HTTP instead")
    p.add_argument("--json", help="append the results as one JSON line to this file")
    args = p.parse_args()
    if args.url:
        return main_http(args)
    # a scored prompt skips the prefix cache (its every position's logits are needed), so the plain one must too:
    # with it on, the plain repeats would prefill only the prompt's last block
    llm = LLM(
        args.model,
        enable_prefix_caching=False,
        max_model_len=args.prompt_len + 128,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
    )
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompt = [rng.randrange(10, min(vocab, 30000)) for _ in range(args.prompt_len)]
    llm.generate([prompt[:64]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)  # warm-up
    plain, scored = latency(llm, prompt, None, args.repeats), latency(llm, prompt, 1, args.repeats)
    batch_plain = in_batch(llm, prompt, None, args.decoders, rng)
    batch_scored = in_batch(llm, prompt, 1, args.decoders, rng)
    c = llm.engine.model_config
    extra_flops = 2 * args.prompt_len * c.hidden_size * c.vocab_size
    extra_bytes = 2 * args.prompt_len * c.vocab_size * 4
    floor_ms = max(extra_flops / PEAK_FLOPS, extra_bytes / PEAK_BYTES_PER_S) * 1e3
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"prompt logprobs: {args.model}, a {args.prompt_len}-token prompt, {device}, torch {torch.__version__}")
    print(f"{'':38}{'plain':>10}{'prompt_logprobs':>17}")
    print(f"{'latency, alone (ms)':38}{plain * 1e3:10.1f}{scored * 1e3:17.1f}")
    steps = batch_plain["prefill_steps_ms"], batch_scored["prefill_steps_ms"]
    print(f"{'its prefill steps beside decoders (ms)':38}{steps[0]:10.1f}{steps[1]:17.1f}")
    print(
        f"{'decoders step after it (ms)':38}{batch_plain['decode_step_ms']:10.2f}{batch_scored['decode_step_ms']:17.2f}"
    )
    print(f"the extra work: {(scored - plain) * 1e3:.1f} ms alone; its floor {floor_ms:.1f} ms", end=" ")
    print(f"({extra_flops / 1e12:.1f} TFLOP, {extra_bytes / 1e9:.1f} GB)")
    if args.json:
        row = dict(model=args.model, prompt_len=args.prompt_len, device=device, plain_s=plain, scored_s=scored)
        row.update(batch_plain={**batch_plain}, batch_scored={**batch_scored}, floor_ms=floor_ms)
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
