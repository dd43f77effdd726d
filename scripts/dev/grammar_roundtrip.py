"""What a large JSON schema's grammar costs on its way into the engine core: xgrammar's compile, the compile
process's `serialize_json`, the engine's `deserialize_json`, and the longest the interpreter's lock kept another
Python thread waiting during the read-back (the engine's loop would wait as long).

    python scripts/dev/grammar_roundtrip.py MODEL_DIR --properties 600
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import xgrammar as xgr
from transformers import AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--properties", type=int, default=600, help="optional string properties of the schema")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(args.properties)}}
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(schema))
    took = time.perf_counter() - start
    print(f"compile {took:.2f} s (memory_size_bytes {grammar.memory_size_bytes / 2**20:.1f} MiB)")
    start = time.perf_counter()
    text = grammar.serialize_json()
    print(f"serialize_json {time.perf_counter() - start:.2f} s, {len(text) / 2**20:.0f} MiB")
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    xgr.CompiledGrammar.deserialize_json(text, info)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    longest = max(b - a for a, b in zip(ticks, ticks[1:]))
    print(f"deserialize_json {took:.2f} s; another thread's longest wait meanwhile {longest * 1000:.0f} ms")


if __name__ == "__main__":
    main()
