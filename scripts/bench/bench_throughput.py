"""Offline throughput on nano-vllm's workload, with Hugging Face `generate()` as the peer.

Workload: 256 sequences, seed 0, prompt and output lengths uniform in [100, 1024], random token ids,
ignore_eos. Kiln runs them all through `LLM.generate`; the peer runs Hugging Face `generate()` with a
static cache (which transformers compiles) in batches of 64, each generating the workload's mean
output length, so both produce the same total number of output tokens.

    python scripts/bench/bench_throughput.py --model qwen3-0.6b --enforce-eager --hf
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from kiln.compile.counters import TRITON_EVENTS
from kiln.engine import LLM, SamplingParams
from kiln.engine.config import EngineConfig
from kiln.engine.models.source import resolve_model


def workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, min(vocab, 10000) - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)
    ]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def bench_kiln(args, prompts, output_lens) -> dict:
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        cudagraph_capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",")),
        async_scheduling=not args.no_async_scheduling,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    sync()
    before = dict(TRITON_EVENTS)
    start = time.perf_counter()
    llm.engine.step_timing = type(llm.engine.step_timing)()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    # a kernel compiled inside the timed run would cost seconds; one loaded from Triton's disk cache, milliseconds
    compiles, hits = (TRITON_EVENTS[k] - before[k] for k in ("compiles", "cache_hits"))
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(output_lens)
    t = llm.engine.step_timing
    mode = "eager" if args.enforce_eager else "compiled+graphs"
    return {
        "engine": f"kiln {mode}{'' if args.no_async_scheduling else ' + async'}",
        "seconds": elapsed,
        "output_tokens": num_out,
        "tokens_per_s": num_out / elapsed,
        "steps": t.steps,
        "host_s": t.host_seconds,
        "wait_s": t.wait_seconds,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "kv_blocks": llm.engine.num_kv_blocks,
        # (what a run's arguments set, so a row of the JSON file says which run it was)
        **{
            k: getattr(llm.engine.config, k)
            for k in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization")
        },
        "triton_compiles": compiles,
        "triton_cache_hits": hits,
    }


def bench_hf(args, prompts, output_lens) -> dict:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    source = resolve_model(args.model)
    dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype).cuda().eval()
    new_tokens = round(sum(output_lens) / len(output_lens))
    batches = [prompts[i : i + args.hf_batch] for i in range(0, len(prompts), args.hf_batch)]
    prompt_len = max(len(p) for p in prompts)

    def run(batch, max_new):
        # Left-pad every batch to one length: one static-cache shape, compiled once.
        ids = torch.tensor([[0] * (prompt_len - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (prompt_len - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )
        return (out.shape[1] - prompt_len) * len(batch)

    run(batches[0], new_tokens)  # warm-up: includes torch.compile of the decode step
    sync()
    start = time.perf_counter()
    num_out = sum(run(b, new_tokens) for b in batches)
    sync()
    elapsed = time.perf_counter() - start
    return {
        "engine": f"hf generate (static cache + compile, batch {args.hf_batch})",
        "seconds": elapsed,
        "output_tokens": num_out,
        "tokens_per_s": num_out / elapsed,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="fp8: the linear layers quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    # (a model whose weights leave little room, e.g. a hybrid's recurrent states beside 65 GB on an 80 GB card)
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--capture-sizes", default="1,2,4,8,16,32,64,128,256,512", help="CUDA-graph sizes (compiled)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--hf", action="store_true", help="also run Hugging Face generate() as the peer (CUDA only)")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--json", help="append the results as one JSON line to this file")
    args = p.parse_args()

    vocab = resolve_model(args.model).model_config.vocab_size
    prompts, output_lens = workload(args.num_seqs, args.min_len, args.max_len, vocab)
    results = [bench_kiln(args, prompts, output_lens)]
    if args.hf:
        results.append(bench_hf(args, prompts, output_lens))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\nthroughput: {args.model} ({args.dtype}{', fp8 weights' if args.quantization else ''}"
        f"{', fp8 KV' if args.kv_cache_dtype != 'auto' else ''}), {args.num_seqs} seqs, "
        f"lengths U[{args.min_len}, {args.max_len}], "
        f"{'eager' if args.enforce_eager else 'compiled'}, {device}, torch {torch.__version__}"
    )
    print(f"{'engine':<48} {'output tokens':>14} {'seconds':>9} {'tokens/s':>10}")
    for r in results:
        print(f"{r['engine']:<48} {r['output_tokens']:>14} {r['seconds']:>9.2f} {r['tokens_per_s']:>10.0f}")
    if "steps" in results[0]:
        r = results[0]
        print(
            f"kiln: {r['steps']} steps, host {r['host_s']:.2f} s, waiting for the GPU {r['wait_s']:.2f} s, "
            f"{r['preemptions']} preemptions, {r['kv_blocks']} KV blocks, "
            f"{r['triton_compiles']} Triton compiles and {r['triton_cache_hits']} loads from its cache in the run"
        )
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps({"model": args.model, "device": device, "torch": torch.__version__, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
