"""gpt-oss's benchmarks run on the CPU with a tiny MXFP4 checkpoint: bench_latency's roofline counts the chosen
experts' 4-bit bytes (their scales and biases with them), and gpu_check's latency and gpt-oss-moe steps run end to end
(decode at batch 1 and 4 with the roofline; the expert kernels alone, MXFP4 and 16-bit, at 1 and 8 tokens)."""

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

from helpers.gpt_oss import make_tiny_gpt_oss_dir

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    return make_tiny_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss_mxfp4"), mxfp4_experts=True)


def test_a_step_reads_the_chosen_experts_four_bit_bytes(gpt_oss_dir):
    bench_latency = runpy.run_path(str(BENCH / "bench_latency.py"), run_name="bench_latency")
    with LLM(str(gpt_oss_dir), enforce_eager=True, max_model_len=256, max_num_seqs=4) as llm:
        model = llm.engine.executor.model
        every = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight  # untied: a token reads its row only
        every -= embed.numel() * embed.element_size() - embed[0].numel() * embed.element_size()
        # an expert as the checkpoint holds it: hidden 64, intermediate 64, half a byte a weight, a byte a 32 for the
        # scales, the biases (2I + H) in the model's dtype
        hidden = inter = 64
        bias_bytes = model.model.layers[0].mlp.experts.gate_up_proj_bias.element_size()
        per_expert = 3 * hidden * inter // 2 + 3 * hidden * inter // 32 + (2 * inter + hidden) * bias_bytes
        # one token: its 2 of the 4 experts in each of the 4 layers
        assert bench_latency["weight_bytes_read"](model, 1) == every - 4 * 2 * per_expert


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


def test_gpu_check_runs_the_gpt_oss_steps_on_the_cpu(gpt_oss_dir, tmp_path):
    model = str(gpt_oss_dir)
    summary = run_gpu_check(
        tmp_path,
        [f"latency:{model}", f"gpt-oss-moe:{model}"],
        LATENCY_MODES="eager",
        LATENCY_BATCHES="1,4",
        LATENCY_HF="0",
        LATENCY_ARGS="--decode-steps 8 --max-model-len 256",
        MOE_TOKENS="1,8",
    )
    name = gpt_oss_dir.name
    [latency] = (tmp_path / "logs").glob(f"latency_{name}_tp1*.json")
    rows = json.loads(latency.read_text())
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["bw_util"] < 1 and r["kv_bytes"] > 0
    assert rows[1]["weight_bytes"] >= rows[0]["weight_bytes"]  # (four tokens choose at least the experts one does)
    assert "roofline: the bytes a decode step moves" in summary

    moe = json.loads((tmp_path / "logs" / f"gpt_oss_moe_{name}.json").read_text())
    assert [(r["format"], r["tokens"]) for r in moe["rows"]] == [("mxfp4", 1), ("mxfp4", 8), ("bf16", 1), ("bf16", 8)]
    one = next(r for r in moe["rows"] if r["format"] == "mxfp4" and r["tokens"] == 1)
    assert one["experts_read"] == 2 and one["us"] > 0 and one["gb_per_s"] > 0
    assert "gpt-oss MoE" in summary
