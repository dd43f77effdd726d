"""Every Triton kernel's code paths compile for the H200 (sm_90) on this machine, GPU or not: the CPU tests run the
kernels under Triton's interpreter, which accepts what the compiler refuses (a module global that is not a
constexpr, a compile-time branch whose returns differ in type), so a kernel can pass them all and fail on its first
GPU launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "scripts" / "dev" / "kernel_resources.py"


def test_each_kernel_and_code_path_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # (a cached build would skip the compiler)
    # qwen3-0.6b: head_dim 128 and the QK-norm kernel; every family (16-bit, FP8 weights and cache, windows, caps,
    # the MoE routing and FP8 experts, gpt-oss's sinks and MXFP4 experts)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--sample", "--models", "qwen3-0.6b"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("qwen3-0.6b")]
    families = {"decode", "prefill", "gemv", "window", "softcap", "fp8_kv", "fp8_gemv", "fp8_quant", "fp8_block"}
    families |= {"moe_routing", "moe_fp8", "sinks", "gpt_oss_moe"}
    assert {line.split()[1] for line in compiled} >= families
