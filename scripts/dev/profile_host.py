"""Host (Python) time per engine step at 256 decoding sequences, on the CPU, with the model's own time taken out:

    python scripts/dev/profile_host.py                      # async scheduling (the default)
    python scripts/dev/profile_host.py --no-async-scheduling
    python scripts/dev/profile_host.py --kind gemma3 --stub-model   # gemma-3-12b's 48 layers and KV groups

A tiny random-weight Llama (the tests' model, positions raised to 131,072; --max-model-len 2048 by default)
serves 256 greedy requests through `LLM.generate`, prompt lengths uniform in [100, 1024] as in
bench_throughput.py. Steps whose batch is 256 one-token decodes are measured with `time.process_time()`; each
part below is timed around its function, and `model` (forward, logits, sampler kernels) is subtracted from the
total. `LLM._run` (llm_run) is the time between two `engine.step()` calls; `gc` is the garbage collector's
share, already counted inside the parts. `--kind gemma3`: a tiny Gemma 3 of gemma-3-12b's layer pattern (48
layers, 5 sliding of window 1,024 to 1 global: six KV groups), for the host cost of the hybrid KV groups. The
whole run repeats and each part reports the minimum over repeats of its mean per step, in µs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from kiln.engine import LLM, SamplingParams

PARTS = (
    "schedule",
    "prepare_inputs",
    "sampling_metadata",
    "collect",
    "update",
    "llm_run",
    "other",
    "host",
    "model",
    "gc",
)


def make_model_dir(path: Path, kind: str = "llama") -> Path:
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers.models import make_tiny_model_dir, tiny_hf_config  # noqa: PLC0415

    if kind == "gemma3":
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        from kiln.engine.text.tokenizer import builtin_tokenizer  # noqa: PLC0415

        config = tiny_hf_config("gemma3")
        config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 48, 1024, 131072
        config.layer_types = [("full" if i % 6 == 5 else "sliding") + "_attention" for i in range(48)]
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        builtin_tokenizer(config.vocab_size).save_pretrained(path)
        return path
    make_tiny_model_dir(path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (path / "config.json").write_text(json.dumps(config))
    return path


class StepClock:
    """Accumulates process time per part for the current step; `step()` closes a step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.measured = False  # whether this step's batch is all decodes, at full size
        self.steps: list[dict[str, float]] = []
        self.wrapped: list[tuple[object, str]] = []

    def wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[part] += time.process_time() - start

        setattr(obj, name, timed)
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self.wrapped:
            obj.__dict__.pop(name, None)


def run_once(llm: LLM, prompts, num_steps: int, num_seqs: int, stub_model: bool) -> dict[str, float]:
    engine, runner = llm.engine, llm.engine.runner
    clock = StepClock()
    schedule = engine.scheduler.schedule

    def watched_schedule():
        batch = schedule()
        clock.measured = len(batch.requests) == num_seqs and batch.total_num_tokens == num_seqs
        return batch

    engine.scheduler.schedule = watched_schedule
    clock.wrapped.append((engine.scheduler, "schedule"))
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(runner, "prepare_inputs", "prepare_inputs")
    if stub_model:  # the host side alone: no forward pass, zero hidden states (so every token is the same)
        hidden_size = engine.model_config.hidden_size
        runner.forward = lambda metadata, plan: (torch.zeros(plan.num_tokens, hidden_size), None)
        clock.wrapped.append((runner, "forward"))
    clock.wrap(runner, "forward", "model")
    clock.wrap(runner.model, "compute_logits", "model")
    clock.wrap(runner.sampler, "forward", "model")
    clock.wrap(runner, "collect", "collect")
    clock.wrap(engine, "_update", "update")
    clock.wrap(runner, "sampling_metadata", "sampling_metadata")
    gc_start = 0.0

    def gc_clock(phase: str, info: dict) -> None:
        nonlocal gc_start
        if phase == "start":
            gc_start = time.process_time()
        else:
            clock.current["gc"] += time.process_time() - gc_start

    gc.callbacks.append(gc_clock)
    step = engine.step
    last_return = None

    def timed_step(*args, **kwargs):
        nonlocal last_return
        start = time.process_time()
        if clock.steps and last_return is not None:
            clock.steps[-1]["llm_run"] = start - last_return
        clock.current = defaultdict(float)
        outputs = step(*args, **kwargs)
        last_return = time.process_time()
        if clock.measured:
            clock.current["total"] = last_return - start
            clock.steps.append(clock.current)
        return outputs

    engine.step = timed_step
    clock.wrapped.append((engine, "step"))
    params = SamplingParams(temperature=0, max_tokens=num_steps + 40, ignore_eos=True)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        gc.callbacks.remove(gc_clock)
        clock.unwrap()
    steps = [s for s in clock.steps if "llm_run" in s]
    mean = {part: sum(s.get(part, 0.0) for s in steps) / len(steps) for part in (*PARTS, "total")}
    named = sum(mean[p] for p in ("schedule", "prepare_inputs", "sampling_metadata", "collect", "update", "model"))
    mean["other"] = mean["total"] - named
    mean["host"] = mean["total"] - mean["model"] + mean["llm_run"]
    mean["steps"] = len(steps)
    return mean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=60, help="decode steps per run (about; the tail is dropped)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kind", choices=("llama", "gemma3"), default="llama")
    p.add_argument("--stub-model", action="store_true", help="skip the forward pass (fast; host numbers alike)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randint(1, 500) for _ in range(rng.randint(100, 1024))] for _ in range(args.num_seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp), args.kind)
        llm = LLM(
            str(model_dir),
            enforce_eager=True,
            max_num_seqs=args.num_seqs,
            max_model_len=args.max_model_len,  # (the block table's width: a preset's 131,072 is 8,192 blocks)
            num_kv_blocks=args.num_seqs * 2048 // 16 * (6 if args.kind == "gemma3" else 1) + 1,  # (a block a group)
            async_scheduling=not args.no_async_scheduling,
        )
        runs = [run_once(llm, prompts, args.steps, args.num_seqs, args.stub_model) for _ in range(args.repeats)]
    best = {part: min(run[part] for run in runs) for part in PARTS}
    mode = "sync" if args.no_async_scheduling else "async"
    print(
        f"host µs per step, {args.num_seqs} decoding sequences, {mode} scheduling, "
        f"min over {args.repeats} runs of {min(r['steps'] for r in runs)}+ steps:"
    )
    for part in PARTS:
        print(f"  {part:18s} {best[part] * 1e6:9.0f}")


if __name__ == "__main__":
    main()
