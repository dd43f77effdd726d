"""Structured output: the per-step cost of the grammar mask, constrained versus unconstrained decode steps.

At each batch size the same decode runs three ways: unconstrained (async scheduling: the host prepares
step N+1 while the GPU runs step N), unconstrained with async scheduling off, and every request under a
JSON schema (a constrained request needs its matcher advanced before the next mask, so its steps are
synchronous). The mask columns are the host's time filling the bitmask, which overlaps the forward pass,
and the overhead is constrained minus unconstrained-sync (the mask itself) and minus async (all told).

Presets have dummy weights, so their output is noise: the schema is an object holding an array of at least
100,000 integers, which no timed run can close (noise at temperature 1 closes a plain array within tens of
tokens), so every step masks (most tokens barred: digits, commas, spaces). A preset's
built-in tokenizer has only ~1,000 tokens; the default `--vocab synthetic` compiles grammars for a
synthetic byte-level vocabulary of the preset's size instead (words, numbers, punctuation runs), which is
what the mask's cost scales with.

    python scripts/bench/bench_structured.py --model llama-3.2-1b --batches 1,16,64
    python scripts/bench/bench_structured.py --model /path/to/tiny-model --batches 1,4 --steps 8   # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from kiln.engine import LLM, SamplingParams, StructuredOutputParams
from kiln.engine.models.source import resolve_model
from kiln.engine.structured_output.grammar import GrammarBitmask
from kiln.engine.text.tokenizer import synthetic_tokenizer

PROMPT_LEN = 32
WARMUP_STEPS = 4  # prefill and the first decodes are not timed
SCHEMA = {
    "type": "object",
    "required": ["values"],
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 100_000}},
}


def timed_steps(llm: LLM, batch: int, steps: int, constrained: bool, async_scheduling: bool) -> dict:
    """Mean wall time of the decode steps of `batch` requests, and the host's bitmask-fill time per step."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling  # NOTE: read at every step; the bench flips it between runs
    so = StructuredOutputParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=WARMUP_STEPS + steps + 2, ignore_eos=True, structured_output=so
    )
    vocab = min(engine.model_config.vocab_size, 1000)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", [(7 * i + j) % vocab + 1 for j in range(PROMPT_LEN)], params)
    fill_seconds = 0.0
    fill = GrammarBitmask.fill

    def timed_fill(self, *args) -> None:
        nonlocal fill_seconds
        start = time.perf_counter()
        fill(self, *args)
        fill_seconds += time.perf_counter() - start

    GrammarBitmask.fill = timed_fill
    try:
        ends, fills, tokens = [time.perf_counter()], [0.0], {}  # after each step: the clock, the fill total
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            ends.append(time.perf_counter())
            fills.append(fill_seconds)
        sync()
    finally:
        GrammarBitmask.fill = fill
    first, last = WARMUP_STEPS, WARMUP_STEPS + steps
    if min(tokens.values()) < params.max_tokens or len(ends) <= last:
        raise RuntimeError(
            f"batch {batch}: a request stopped after {min(tokens.values())} of {params.max_tokens} "
            "tokens, so the batch shrank inside the timed steps"
        )
    return {"step_ms": 1e3 * (ends[last] - ends[first]) / steps, "fill_ms": 1e3 * (fills[last] - fills[first]) / steps}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="a preset (dummy weights) or a local model directory")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per run")
    p.add_argument(
        "--vocab",
        choices=["synthetic", "model"],
        default=None,
        help="synthetic: a made-up vocabulary of the model's size (default for presets); "
        "model: the model's own tokenizer (default for directories)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="default on CPU; CUDA graphs otherwise")
    p.add_argument("--json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    source = resolve_model(args.model)
    vocab = args.vocab or ("synthetic" if source.is_preset else "model")
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        max_model_len=PROMPT_LEN + WARMUP_STEPS + args.steps + 16,
        max_num_seqs=max(batches),
        enforce_eager=args.enforce_eager or not on_gpu,
    )
    if on_gpu:
        kwargs["gpu_memory_utilization"] = 0.8
    with tempfile.TemporaryDirectory() as tmp:
        if vocab == "synthetic":
            synthetic_tokenizer(source.model_config.vocab_size).save_pretrained(tmp)
            kwargs["tokenizer"] = tmp
        llm = LLM(args.model, **kwargs)
        engine = llm.engine
        start = time.perf_counter()
        engine.grammar_admission.cache().get(StructuredOutputParams(json=SCHEMA)).result()
        first_compile_s = time.perf_counter() - start  # with the tokenizer's load and xgrammar's view of it
        start = time.perf_counter()
        engine.grammar_admission.cache().get(StructuredOutputParams(regex="[0-9]{1,6}")).result()
        compile_s = time.perf_counter() - start
        timed_steps(llm, 1, 2, True, True)  # warm-up: the mask kernel, the graphs, xgrammar's threads
        rows = []
        for batch in batches:
            row = {"batch": batch}
            for name, constrained, use_async in (
                ("async", False, True),
                ("sync", False, False),
                ("constrained", True, True),
            ):
                result = timed_steps(llm, batch, args.steps, constrained, use_async)
                row[f"{name}_ms"] = result["step_ms"]
                if constrained:
                    row["fill_ms"] = result["fill_ms"]
            rows.append(row)
    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    mode = "eager" if kwargs["enforce_eager"] else "CUDA graphs"
    print(
        f"\nstructured output: {args.model} ({'dummy weights' if source.is_preset else 'checkpoint'}), {mode}, "
        f"{device}, torch {torch.__version__}, {vocab} vocabulary of {source.model_config.vocab_size}, "
        f"prompt {PROMPT_LEN}, {args.steps} decode steps"
    )
    print(f"grammar compile: first {first_compile_s:.2f} s (tokenizer included), next {compile_s * 1e3:.0f} ms")
    print(
        f"{'batch':>5} {'unconstr. ms':>12} {'sync ms':>8} {'constr. ms':>10} {'mask fill ms':>12} "
        f"{'vs sync':>8} {'vs async':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['async_ms']:>12.2f} {r['sync_ms']:>8.2f} {r['constrained_ms']:>10.2f} "
            f"{r['fill_ms']:>12.2f} {r['constrained_ms'] / r['sync_ms'] - 1:>+8.0%} "
            f"{r['constrained_ms'] / r['async_ms'] - 1:>+8.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "device": device,
                    "vocab": vocab,
                    "first_compile_s": first_compile_s,
                    "compile_s": compile_s,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
