"""The benchmarks of the Gated DeltaNet hybrids run on the CPU with tiny models: bench_latency's roofline (weights,
recurrent states, KV) against what the engine allocates, and gpu_check's steps end to end (decode at batch 1 and 4,
a long context against a short one, the multi-turn time to first token with the prefix cache on and off, FP8 after
bf16), their tables and JSON rows checked for the rows they must have and sane values."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.engine import LLM

from helpers.models import make_tiny_model_dir

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory) -> dict[str, Path]:
    """A dense hybrid (Qwen3.5) and a mixture-of-experts one (Qwen3.5-MoE: 4 experts, 2 a token)."""
    return {kind: make_tiny_model_dir(tmp_path_factory.mktemp(kind), kind) for kind in ("qwen3_5", "qwen3_5_moe")}


@pytest.fixture(scope="module")
def bench_latency():
    return runpy.run_path(str(BENCH / "bench_latency.py"), run_name="bench_latency")


def test_the_roofline_counts_the_states_and_kv_the_engine_allocates(hybrid_dirs, bench_latency):
    with LLM(str(hybrid_dirs["qwen3_5"]), enforce_eager=True, max_model_len=256, max_num_seqs=4) as llm:
        executor = llm.engine.executor
        config = llm.engine.model_config
        # one request's state: a row of every linear layer's conv and delta-rule tensors, as start-up made them
        row = sum(t[0].numel() * t.element_size() for pair in llm.engine.runner.recurrent_states for t in pair)
        assert row > 0
        assert bench_latency["recurrent_state_bytes"](config, 1, executor.dtype.itemsize) == row
        # a token's K and V in each attention layer's cache (the linear layers have none)
        kv_caches = executor.kv_caches
        assert 0 < len(kv_caches) < config.num_layers
        per_token = sum(c[:, 0, 0].numel() * c.element_size() for c in kv_caches)

        prompt, steps = 64, 8
        one, four = (bench_latency["step_bytes"](llm, batch, prompt, steps) for batch in (1, 4))
        assert one["states"] == 2 * row  # read and written back
        assert four["states"] == 4 * one["states"]
        assert one["kv"] == per_token * (prompt + steps // 2)  # the decode's mean context
        assert one["weights"] == four["weights"] > 0  # dense: every weight whatever the batch (embedding rows aside)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_hybrid_moe_step_reads_only_the_chosen_experts(hybrid_dirs, bench_latency, quantization):
    """16-bit experts, and FP8 ones (`--quantization fp8`: their e4m3 bytes and a scale a row)."""
    engine = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4, quantization=quantization)
    with LLM(str(hybrid_dirs["qwen3_5_moe"]), **engine) as llm:
        model = llm.engine.executor.model
        every = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight  # untied: a token reads its row only
        every -= embed.numel() * embed.element_size() - embed[0].numel() * embed.element_size()
        moe = [layer.mlp for layer in model.model.layers]
        experts = moe[0].experts
        assert (experts.num_experts, moe[0].top_k) == (4, 2)
        per_expert = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
        if quantization:
            assert experts.w13.element_size() == 1
            per_expert += (experts.w13_scale[0].numel() + experts.w2_scale[0].numel()) * 4
        # one token: its 2 of the 4 experts in every layer
        assert bench_latency["weight_bytes_read"](model, 1) == every - len(moe) * 2 * per_expert


def run_gpu_check(tmp_path: Path, steps: list[str], **env: str) -> str:
    """gpu_check.sh's steps here, on the CPU (no nvidia-smi: its line in the summary is empty); its summary."""
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), **env}
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"  # python3: this one
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), *steps],
        cwd=BENCH.parents[1],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with tarfile.open(out / "logs.tgz") as logs:
        logs.extractall(tmp_path / "logs", filter="data")
    return (out / "summary.txt").read_text()


def logged(tmp_path: Path, prefix: str, suffix: str = ".json") -> str:
    """The one log file a step wrote whose name starts with `prefix` (the rest: the env settings before it)."""
    [path] = (tmp_path / "logs").glob(f"{prefix}*{suffix}")
    return path.read_text()


def test_gpu_check_runs_the_hybrid_steps_on_the_cpu(hybrid_dirs, tmp_path):
    dense, moe = str(hybrid_dirs["qwen3_5"]), str(hybrid_dirs["qwen3_5_moe"])
    summary = run_gpu_check(
        tmp_path,
        # (bf16 again after the FP8 step, which must not stop the steps after it)
        [f"latency:{dense}", "env:QUANT=fp8", f"latency:{moe}", "env:QUANT=", f"longctx:{dense}", f"multiturn:{dense}"],
        LATENCY_MODES="eager",
        LATENCY_BATCHES="1,4",
        LATENCY_ARGS="--decode-steps 8 --max-model-len 256 --max-num-batched-tokens 256",
        LONGCTX_MODES="eager",
        LONGCTX_PROMPTS="32,256",
        MULTITURN_MODES="eager",
        MULTITURN_ARGS="--turns 3 --first-len 70 --user-len 40 --answer-len 6 --conversations 1",
    )
    name = Path(dense).name

    # batch 1 and 4 decode: every row timed, the bytes of its roofline by kind; the HF peer (no CUDA here) named
    # in a line, Kiln's rows standing
    rows = json.loads(logged(tmp_path, f"latency_{name}_tp1"))
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["bw_util"] < 1
        assert r["weight_bytes"] > 0 and r["state_bytes"] > 0 and r["kv_bytes"] > 0
        assert r["tokens_per_s"] / r["roofline_tokens_per_s"] == pytest.approx(r["bw_util"])
    assert rows[1]["state_bytes"] == 4 * rows[0]["state_bytes"]
    assert "hf static+compile not timed at batch 1" in logged(tmp_path, f"latency_{name}_tp1", ".log")
    assert summary.count("kiln eager") >= 2 and "roofline: the bytes a decode step moves" in summary

    # 256 tokens of context against 32: the same weights and states, more KV read, and the ratio line
    short, long = json.loads(logged(tmp_path, f"longctx_{name}_tp1"))
    assert (short["prompt"], long["prompt"]) == (32, 256)
    assert long["weight_bytes"] == short["weight_bytes"] and long["state_bytes"] == short["state_bytes"]
    assert long["kv_bytes"] > short["kv_bytes"]
    assert "context 256 against 32: kiln eager batch 1" in summary

    # FP8 of a hybrid MoE (--quantization fp8, its experts too): its rows and its table's line; the bf16 steps after it
    assert not [line for line in summary.splitlines() if line.startswith("kiln refused")]
    rows = json.loads(logged(tmp_path, f"latency_{Path(moe).name}_tp1_QUANTfp8"))
    assert [r["batch"] for r in rows] == [1, 4] and all(r["tokens_per_s"] > 0 and r["weight_bytes"] > 0 for r in rows)
    assert "fp8 weights" in summary

    # the multi-turn chat: turn N's prompt is turn N-1's, its answer and a new message; with the cache on, a later
    # turn hits at least the previous prompt's full blocks (the state snapshot there), with it off nothing
    rows = json.loads(logged(tmp_path, f"multiturn_{name}_tp1"))
    on = [r for r in rows if r["prefix_caching"]]
    off = [r for r in rows if not r["prefix_caching"]]
    assert [r["turn"] for r in on] == [r["turn"] for r in off] == [1, 2, 3]
    assert [r["prompt_tokens"] for r in on] == [70, 116, 162] == [r["prompt_tokens"] for r in off]
    assert on[0]["cached_tokens"] == 0 and all(r["cached_tokens"] == 0 for r in off)
    for previous, turn in zip(on, on[1:]):
        assert previous["prompt_tokens"] // 16 * 16 <= turn["cached_tokens"] < turn["prompt_tokens"]
    assert all(r["ttft_s"] > 0 for r in rows)
    table = summary[summary.index("multi-turn time to first token") :].splitlines()
    assert [line.split()[:3] for line in table[2:5]] == [["kiln", "eager", str(t)] for t in (1, 2, 3)]
