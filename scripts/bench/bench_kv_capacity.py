"""The KV cache's capacity in tokens of context, as start-up sizes it, against the same memory with every layer
global: a model mixing sliding and full layers (Gemma 3, Gemma 4) holds only its windows in the sliding ones, and
Gemma 4's shared layers hold none.

    python scripts/bench/bench_kv_capacity.py --model gemma-3-27b --max-model-len 32768
    python scripts/bench/bench_kv_capacity.py --model gemma-4-31b --max-model-len 32768
"""

from __future__ import annotations

import argparse
import json

from kiln.engine import LLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma-3-27b")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, enforce_eager=True) as llm:
        stats, executor = llm.engine.startup_stats, llm.engine.executor
        spec = executor.kv_spec
        blocks, tokens = stats["num_kv_blocks"], stats["kv_cache_tokens"]
    # every layer global, each with KV of its own (Gemma 4's shared layers too): the same bytes, a token of context
    # the K and V rows of every layer
    config = executor.model_config
    rows = [config.kv_heads_of(layer) * config.head_dim_of(layer) for layer in config.attention_layers]
    rows += [
        rows[config.attention_layers.index(config.kv_source_of(layer))]
        for layer in range(config.num_layers)
        if config.kv_source_of(layer) != layer
    ]
    all_global = (blocks - 1) * spec.bytes_per_block // (2 * sum(rows) * spec.dtype.itemsize)
    row = {
        "model": args.model,
        "kv_blocks": blocks,
        "slots": spec.num_slots,
        "layers": spec.num_layers,
        "groups": spec.groups.windows,
        "tokens": tokens,
        "all_global_tokens": all_global,
        "ratio": tokens / all_global,
    }
    print(
        f"KV capacity: {args.model}, {blocks} blocks of {spec.num_slots} of {spec.num_layers} layers' pages, "
        f"groups {spec.groups.windows}"
    )
    print(f"tokens of context {tokens:,}  every layer global {all_global:,}  ratio {tokens / all_global:.2f}x")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
