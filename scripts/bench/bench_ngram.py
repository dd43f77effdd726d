"""N-gram speculative decoding on real text: the default model (SmolLM2-135M-Instruct, its GGUF file) on a workload
whose answers copy their prompts, with drafts and without, on whatever device Kiln picks (the CPU here).

    python scripts/bench/bench_ngram.py                      # k = 3 and 5, compiled
    python scripts/bench/bench_ngram.py --k 2,4 --eager --max-tokens 256

Each task asks the model to rewrite a text it is given with a small change (rename in code, quote and summarise,
reorder a list), so much of each answer repeats the prompt, as code edits and agent tool arguments do. Greedy: the
answers with drafts must equal those without, token for token (checked). Printed per setting: tokens/s (the wall
time of the whole batch, one request at a time, median of three), the draft tokens kept over those verified, the mean
tokens a step yields per request (1 + kept drafts), and the speedup over no drafts.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kiln.engine import LLM, SamplingParams
from kiln.engine.cli import _chat_ids

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
ARTICLE = (
    "The committee met on Tuesday to review the budget. Members agreed that the library roof must be repaired "
    "before winter, that the park lights should be replaced with LED lamps, and that the summer festival will move "
    "to the second week of August. The chair said the repairs would cost about forty thousand dollars."
)
TASKS = [
    f"Rename the variable `subtotal` to `net` in this function and show the whole function:\n\n{CODE}",
    f"Add a docstring to this function and show the whole function, unchanged otherwise:\n\n{CODE}",
    f"Quote the first two sentences of this text exactly, then summarise the rest in one sentence:\n\n{ARTICLE}",
    f"Rewrite this text replacing 'Tuesday' with 'Monday', changing nothing else:\n\n{ARTICLE}",
    "Repeat this list in reverse order, one item per line: apples, bread, cheese, dates, eggs, flour, grapes, honey.",
]


def run(llm: LLM, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for the tasks one at a time (batch 1), and their tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [_chat_ids(llm.tokenizer, task) for task in TASKS]
    start, tokens = time.perf_counter(), []
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens.append(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="3,5", help="comma-separated num_speculative_tokens to try")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (default: compiled)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = dict(enforce_eager=args.eager, max_model_len=2048)
    rows, reference = [], None
    for k in [0, *(int(x) for x in args.k.split(","))]:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4} if k else None
        with LLM(speculative_config=spec, **common) as llm:
            run(llm, 8)  # (warm-up: the compile and the kernels)
            scheduler = llm.engine.scheduler
            before = (scheduler.num_spec_steps, scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
            times = []
            for _ in range(args.repeats):
                seconds, tokens = run(llm, args.max_tokens)
                times.append(seconds)
            after = (scheduler.num_spec_steps, scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
            steps, drafted, kept = (now - then for now, then in zip(after, before))
        if reference is None:
            reference = tokens
        assert tokens == reference, f"k={k}: the answers with drafts differ from those without"
        num_tokens = sum(len(t) for t in tokens)
        rows.append((k, num_tokens / statistics.median(times), kept / drafted if drafted else 0.0, steps, kept))
    base = rows[0][1]
    print(f"{'k':>3} {'tok/s':>8} {'kept':>7} {'tokens/step':>12} {'speedup':>8}")
    for k, rate, acceptance, steps, kept in rows:
        per_step = 1 + kept / steps if steps else 1.0
        print(f"{k:>3} {rate:>8.1f} {acceptance:>7.1%} {per_step:>12.2f} {rate / base:>7.2f}x")


if __name__ == "__main__":
    main()
