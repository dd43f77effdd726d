"""Decode latency: tokens/s and memory-bandwidth use at batch 1, 8, 64, in eager, compiled, and
compiled + CUDA graphs modes, with Hugging Face `generate()` (static cache + compile) as the peer.

Bandwidth use = bytes a decode step moves / step time / the card's achievable bandwidth (roofline.py: 4.3 TB/s on
an H200; the roofline: those bytes at that rate), counting
what a step must move on one GPU (`step_bytes`): every weight once, but of an untied input embedding only the batch's
rows and of a mixture of experts only the experts its tokens chose (`weight_bytes_read`); the attention layers' KV
read; and, for a Gated DeltaNet hybrid (Qwen3.5/3.6, Qwen3-Next), each request's recurrent state read and written
back by every linear layer (`recurrent_state_bytes`). A hybrid's linear layers cost the same at any context, its
attention layers grow with it: with several `--prompt-lens`, the table ends with each point's tok/s against the
shortest prompt's (decode at 32k against 2k).

    python scripts/bench/bench_latency.py --model llama-3.2-1b --modes eager,compiled,graphs --batches 1,8,64 --hf
    python scripts/bench/bench_latency.py --model llama-3.1-8b --modes graphs --batches 1 --prompt-lens 32,2048,8192
    python scripts/bench/bench_latency.py --model qwen3.6-35b-a3b --modes graphs --batches 1 --prompt-lens 2048,32768
    python scripts/bench/bench_latency.py --model gpt-oss-120b --modes graphs --batches 1,8,64   # 4-bit experts read

`--quantization fp8` times the 16-bit checkpoint's weights quantized at load (linear layers and experts in e4m3: their
bytes and scales in the roofline), beside the bf16 run of another call; on a model Kiln does not quantize (a mixture
whose experts are its own: gpt-oss's) it prints the one-line refusal where the table would be, and exits 0.

`--breakdown` measures where a decode step's time goes, per batch size, in each mode with and without
async scheduling: step time (wall), host time (the engine's CPU work: schedule, prepare, launch,
output processing), GPU kernel time (torch.profiler, a second pass), and the share of the step the GPU
sits idle waiting for the host, 1 - kernel / step. It writes a table, a JSON file and a PNG plot:

    python scripts/bench/bench_latency.py --model llama-3.2-1b --breakdown --batches 1,2,4,8,16,32,64,128,256 \
        --json breakdown.json --plot breakdown.png
    python scripts/bench/bench_latency.py --plot breakdown.png --from-json breakdown.json   # plot elsewhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from roofline import peak_bytes_per_s

from kiln.engine import LLM, SamplingParams
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.gpt_oss import GptOssMoE
from kiln.engine.models.moe import SparseMoeBlock
from kiln.engine.models.parallel import kv_heads_per_rank
from kiln.engine.models.source import resolve_model

PEAK_BYTES_PER_S = peak_bytes_per_s()
PROMPT_LEN, DECODE_STEPS = 32, 128

MODES = {
    "eager": dict(enforce_eager=True),
    "compiled": dict(cudagraph_mode="none"),
    "graphs": dict(cudagraph_mode="full_and_piecewise"),
}


def weight_bytes_read(model: torch.nn.Module, num_tokens: int) -> int:
    """The weight bytes a decode step of `num_tokens` tokens reads on one GPU: every parameter (a tied embedding once:
    the LM head reads it whole), except that an untied input embedding gives only one row a token, and a mixture of
    experts' layer only the experts its tokens chose: E * (1 - (1 - k/E)^T) of them expected, if the router spreads
    tokens evenly (as random weights do), k at batch 1 (gpt-oss's: their MXFP4 bytes, scales and biases)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if embed is not head:
        row = embed.shape[1] * embed.element_size()
        weights -= embed.numel() * embed.element_size() - min(num_tokens, embed.shape[0]) * row
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):  # (FP8 experts: their e4m3 bytes and their scales)
            experts, top_k = tuple(layer.mlp.experts.parameters()), layer.mlp.top_k
        elif hasattr(layer, "experts"):  # (Gemma 4's, beside the dense MLP)
            experts, top_k = (layer.experts.gate_up_proj, layer.experts.down_proj), layer.top_k
        elif isinstance(layer.mlp, GptOssMoE):  # (gpt-oss's: MXFP4 bytes and their scales, or 16-bit; and biases)
            experts, top_k = tuple(layer.mlp.experts.parameters()), layer.mlp.top_k
        else:
            continue
        num_experts = experts[0].shape[0]
        per_expert = sum(t[0].numel() * t.element_size() for t in experts)
        chosen = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)
        weights -= int((num_experts - chosen) * per_expert)
    return weights


def recurrent_state_bytes(config: ModelConfig, tp_size: int, conv_dtype_bytes: int) -> int:
    """One request's recurrent state on one GPU, summed over the linear layers: the conv window [K-1, conv_dim] (this
    rank's q, k and v channels) in the model's dtype and the delta rule's matrix a value head, [Dk, Dv], in float32
    (backends/linear_attention). A decode step reads it and writes it back, so it moves twice this. 0 for a model
    without linear layers."""
    if not config.linear_layers:
        return 0
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim // tp_size
    value_heads = config.linear_num_value_heads // tp_size
    conv_dim = 2 * key_dim + value_heads * config.linear_value_head_dim
    conv = (config.linear_conv_kernel_dim - 1) * conv_dim * conv_dtype_bytes
    delta_rule = value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return len(config.linear_layers) * (conv + delta_rule)


def step_bytes(llm: LLM, batch: int, prompt_len: int = PROMPT_LEN, decode_steps: int = DECODE_STEPS) -> dict[str, int]:
    """The bytes one decode step of `batch` requests moves on one GPU (under TP, one rank's share), by kind: the
    weights read, the recurrent states read and written (a hybrid's linear layers), the KV read (the attention
    layers, at the decode's mean context)."""
    executor = llm.engine.executor
    c = llm.engine.model_config
    weights = weight_bytes_read(executor.model, batch)
    states = 2 * recurrent_state_bytes(c, executor.shard.size, executor.dtype.itemsize) * batch
    avg_context = prompt_len + decode_steps / 2
    kv_bytes = executor.kv_spec.dtype.itemsize
    # a sliding layer reads only its window's keys; a hybrid's linear layers keep no KV; Gemma 4's layers have heads of
    # two sizes, and its shared layers read their source's KV again
    kv = 0
    for layer in (layer for layer in range(c.num_layers) if layer not in c.linear_layers):
        kv_heads = kv_heads_per_rank(c.kv_heads_of(layer), executor.shard.size)  # under TP: what one GPU reads
        context = min(avg_context, c.window_of(layer) or avg_context)
        kv += 2 * kv_heads * c.head_dim_of(layer) * kv_bytes * context * batch
    return {"weights": weights, "states": states, "kv": int(kv)}


def decode_tokens_per_s(
    llm: LLM, batch: int, prompt_len: int = PROMPT_LEN, decode_steps: int = DECODE_STEPS
) -> tuple[float, float]:
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(prompt_len)] for i in range(batch)]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sync()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        return time.perf_counter() - start

    # Warm-up, twice: the second run hits the prefix cache like the timed ones, so its prefill shape
    # (and any kernel specialised on it) is compiled before the clock starts.
    timed(4)
    timed(4)
    llm.engine.step_timing = type(llm.engine.step_timing)()
    long = timed(decode_steps + 1)
    t = llm.engine.step_timing
    print(
        f"batch {batch}: {t.steps} steps, host {t.host_seconds / t.steps * 1e3:.3f} ms/step, "
        f"wait {t.wait_seconds / t.steps * 1e3:.3f} ms/step, wall {long / t.steps * 1e3:.3f} ms/step",
        flush=True,
    )
    # the prefill cancels out, in medians of three runs against their run-to-run noise; at long batched prompts
    # (64 x 8k) it does not quite (the 1-step runs' prefill costs more), and profile_step's GPU time is the figure
    long = statistics.median([long, timed(decode_steps + 1), timed(decode_steps + 1)])
    step = (long - statistics.median(timed(1) for _ in range(3))) / decode_steps
    return batch / step, sum(step_bytes(llm, batch, prompt_len, decode_steps).values()) / step / PEAK_BYTES_PER_S


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def breakdown(llm: LLM, batch: int, steps: int = 64) -> dict:
    """Per decode step at `batch`: wall, host, wait and GPU-kernel milliseconds."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)] for i in range(batch)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
        engine.step()  # the prefills
    for _ in range(4):
        engine.step()

    engine.step_timing = type(engine.step_timing)()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = (time.perf_counter() - start) / steps
    timing = engine.step_timing

    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    kernel = 0.0
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        kernel = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / steps
    engine.abort_requests(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch": batch,
        "step_ms": wall * 1e3,
        "host_ms": timing.host_seconds / timing.steps * 1e3,
        "wait_ms": timing.wait_seconds / timing.steps * 1e3,
        "kernel_ms": kernel * 1e3,
        "gpu_idle": max(0.0, 1 - kernel / wall),
        "tokens_per_s": batch / wall,
    }


def run_breakdown(args, batches: list[int], sizes: tuple[int, ...] | None) -> list[dict]:
    rows = []
    for mode in args.modes.split(","):
        for async_scheduling in (False, True):
            kwargs = dict(
                MODES[mode],
                max_model_len=args.max_model_len,
                max_num_seqs=max(batches),
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization,
                async_scheduling=async_scheduling,
            )
            if mode == "graphs" and sizes:
                kwargs["cudagraph_capture_sizes"] = sizes
            llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, **kwargs)
            for batch in batches:
                row = breakdown(llm, batch)
                row["mode"] = f"{mode}{' + async' if async_scheduling else ''}"
                rows.append(row)
                print(
                    f"{row['mode']:<18} {batch:>5} step {row['step_ms']:7.3f} ms  host {row['host_ms']:7.3f}  "
                    f"wait {row['wait_ms']:7.3f}  kernels {row['kernel_ms']:7.3f}  GPU idle {row['gpu_idle']:4.0%}  "
                    f"{row['tokens_per_s']:9.0f} tok/s",
                    flush=True,
                )
            llm.close()  # (its KV cache too: the next mode's engine sizes its own from what is free)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def plot_breakdown(rows: list[dict], path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415  (only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_idle, ax_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        style = "-" if "async" in mode else "--"
        ax_idle.plot([r["batch"] for r in mine], [100 * r["gpu_idle"] for r in mine], style, marker="o", label=mode)
        ax_step.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], style, marker="o", label=mode)
    kernels = {r["batch"]: r["kernel_ms"] for r in rows if r["mode"].startswith("graphs")}
    ax_step.plot(list(kernels), list(kernels.values()), ":", color="black", label="GPU kernels (graphs)")
    for ax in (ax_idle, ax_step):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch size")
        ax.grid(alpha=0.3)
    ax_idle.set_ylabel("GPU idle, waiting for the host (% of a step)")
    ax_step.set_ylabel("step time (ms)")
    ax_step.set_yscale("log")
    ax_step.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def hf_tokens_per_s(model_name: str, batch: int, cache: str = "static", decode_steps: int = DECODE_STEPS) -> float:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    # NOTE: built on the GPU: the random initialisation of an 8B model on the CPU outlasted a device call's step
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(resolve_model(model_name).hf_config, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 1000, (batch, PROMPT_LEN), device="cuda")

    def timed(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation=cache,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(decode_steps + 1)  # warm-up: compiles the decode step
    return batch * decode_steps / (timed(decode_steps + 1) - timed(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--quantization", default=None, help="fp8: the linear layers quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    p.add_argument("--modes", default="eager,compiled,graphs")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--capture-sizes", default=None, help="comma-separated; default: the engine's")
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate()")
    p.add_argument("--hf-batches", default="1", help="batches at which to time Hugging Face")
    p.add_argument(
        "--hf-cache",
        default="static",
        choices=["static", "dynamic"],
        help="Hugging Face's KV cache: static (transformers compiles the decode step) or dynamic (eager, as a "
        "mixture of experts runs there: its expert loop does not compile)",
    )
    p.add_argument("--json")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="(a 35B model on an 80 GB card: 0.93)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="a step's token budget: a smaller one lowers the start-up profile's activation peak (a model that "
        "barely fits)",
    )
    p.add_argument(
        "--prompt-lens",
        default=str(PROMPT_LEN),
        help="tokens a prompt, comma-separated, each timed at every batch (the decode steps attend to "
        "this much context and more; the model length grows to fit the longest)",
    )
    p.add_argument(
        "--decode-steps", type=int, default=DECODE_STEPS, help="decode steps a timed run (fewer for a CPU run)"
    )
    p.add_argument("--breakdown", action="store_true", help="host vs GPU time per step, per batch size")
    p.add_argument("--plot", help="PNG path for the breakdown plot")
    p.add_argument("--from-json", help="plot an earlier --breakdown JSON instead of measuring")
    args = p.parse_args()
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    args.max_model_len = max(args.max_model_len, max(prompt_lens) + 2 * args.decode_steps + 16)
    batches = [int(b) for b in args.batches.split(",")]
    if args.max_num_batched_tokens < max(batches):
        p.error(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} is below batch {max(batches)}: a decode step "
            "would then leave requests out"
        )
    sizes = tuple(int(s) for s in args.capture_sizes.split(",")) if args.capture_sizes else None
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        plot_breakdown(data["rows"], args.plot, data["title"])
        return
    if args.breakdown:
        title = f"{args.model}, bf16, {device_name()}, torch {torch.__version__}"
        rows = run_breakdown(args, batches, sizes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"title": title, "rows": rows}, f, indent=1)
        if args.plot:
            try:
                plot_breakdown(rows, args.plot, title)
            except ImportError:
                print("matplotlib is missing: plot later with --from-json")
        return
    rows, roofline, refused, what = [], {}, None, []  # what: the dtype and the weights, once an engine has started
    for mode in args.modes.split(","):
        kwargs = dict(
            MODES[mode],
            max_model_len=args.max_model_len,
            max_num_seqs=max(batches),
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if mode == "graphs" and sizes:
            kwargs["cudagraph_capture_sizes"] = sizes
        try:
            llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, **kwargs)
        except ValueError as e:  # what the engine refuses (FP8 of gpt-oss's experts): one line, and the next step runs
            quantized = f" with --quantization {args.quantization}" if args.quantization else ""
            refused = f"kiln refused {args.model}{quantized}: {e}"
            print(refused, flush=True)
            break  # (every mode would refuse it alike)
        what = [
            str(llm.engine.executor.dtype).removeprefix("torch."),
            "dummy weights" if llm.uses_dummy_weights else "checkpoint weights",
        ]
        for prompt_len in prompt_lens:
            for batch in batches:
                tps, util = decode_tokens_per_s(llm, batch, prompt_len, args.decode_steps)
                moved = roofline[batch, prompt_len] = step_bytes(llm, batch, prompt_len, args.decode_steps)
                rows.append(
                    {
                        "engine": f"kiln {mode}",
                        "batch": batch,
                        "prompt": prompt_len,
                        "tokens_per_s": tps,
                        "roofline_tokens_per_s": batch * PEAK_BYTES_PER_S / sum(moved.values()),
                        "weight_bytes": moved["weights"],
                        "state_bytes": moved["states"],
                        "kv_bytes": moved["kv"],
                        "bw_util": util,
                        "startup_s": llm.engine.startup_stats["total_seconds"],
                        "kv_blocks": llm.engine.num_kv_blocks,
                    }
                )
        llm.close()  # its GPU memory back before the next mode's engine sizes its KV cache (`del` alone kept it)
        del llm
    if args.hf and refused is None:
        for batch in (int(b) for b in args.hf_batches.split(",")):
            engine = "hf static+compile" if args.hf_cache == "static" else "hf eager"
            try:
                tps = hf_tokens_per_s(args.model, batch, args.hf_cache, args.decode_steps)
            except Exception as e:  # (a peer that cannot run this model leaves Kiln's rows standing)
                print(f"{engine} not timed at batch {batch}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            rows.append(
                {
                    "engine": engine,
                    "batch": batch,
                    "prompt": PROMPT_LEN,
                    "tokens_per_s": tps,
                    "roofline_tokens_per_s": float("nan"),
                    "bw_util": float("nan"),
                    "startup_s": float("nan"),
                    "kv_blocks": 0,
                }
            )
    print_table(args, what, rows, roofline, refused)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)  # (none when refused)


def print_table(args, what: list[str], rows: list[dict], roofline: dict, refused: str | None) -> None:
    """The table (what gpu_check's summary keeps, from its first line), the roofline's bytes, and each longer
    prompt's tok/s against the shortest's."""
    what = [
        *what,
        *(["fp8 weights"] if args.quantization else []),
        *(["fp8 KV"] if args.kv_cache_dtype != "auto" else []),
    ]
    print(
        f"\ndecode latency: {', '.join([args.model, *what])}, {args.decode_steps} steps after the prompt, "
        f"{device_name()}, torch {torch.__version__}, TP={args.tensor_parallel_size} "
        f"(BW util: what one GPU moves, against {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)"
    )
    if refused:
        print(refused)
        return
    print(
        f"{'engine':<20} {'batch':>5} {'prompt':>6} {'tokens/s':>10} {'roofline':>10} {'BW util':>8} "
        f"{'startup s':>10} {'KV blocks':>10}"
    )
    for r in rows:
        print(
            f"{r['engine']:<20} {r['batch']:>5} {r['prompt']:>6} {r['tokens_per_s']:>10.0f} "
            f"{r['roofline_tokens_per_s']:>10.0f} {r['bw_util']:>8.0%} {r['startup_s']:>10.1f} "
            f"{r['kv_blocks'] or '':>10}"
        )
    print("roofline: the bytes a decode step moves on one GPU (MB)")
    print(f"{'batch':>5} {'prompt':>6} {'weights':>10} {'states':>10} {'KV':>10} {'total':>10}")
    for (batch, prompt), moved in roofline.items():
        print(
            f"{batch:>5} {prompt:>6} {moved['weights'] / 1e6:>10.1f} {moved['states'] / 1e6:>10.1f} "
            f"{moved['kv'] / 1e6:>10.1f} {sum(moved.values()) / 1e6:>10.1f}"
        )
    shortest: dict[tuple[str, int], dict] = {}  # (engine, batch) -> its row of the shortest prompt
    for r in rows:
        key = (r["engine"], r["batch"])
        if key not in shortest or r["prompt"] < shortest[key]["prompt"]:
            shortest[key] = r
    for r in rows:
        base = shortest[r["engine"], r["batch"]]
        if r is not base:
            print(
                f"context {r['prompt']} against {base['prompt']}: {r['engine']} batch {r['batch']} "
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s "
                f"(roofline {r['roofline_tokens_per_s'] / base['roofline_tokens_per_s']:.2f}x)"
            )


if __name__ == "__main__":
    main()
