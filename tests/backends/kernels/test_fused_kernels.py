"""Fused Triton kernels against the layers' plain-torch forms (Triton's interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.backends import environment
from kiln.backends.kernels import fused as fused_kernels
from kiln.backends.kernels import gemv
from kiln.engine.models.layers import RMSNorm, RotaryEmbedding, _rotate, rms_norm, silu_and_mul, use_fused_kernels

from helpers.kernels import DEVICE, DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_()
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    ref_plain, (ref_out, ref_res) = norm(x), norm(x, residual)
    use_fused_kernels(norm, True)
    close(norm(x), ref_plain, dtype)
    out, res = norm(x, residual)
    close(out, ref_out, dtype)
    close(res, ref_res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,scaling",
    [
        (64, None),
        (
            128,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_rotary_embedding(dtype, head_dim, scaling):
    rope = RotaryEmbedding(head_dim, 512, 10000.0, scaling).to(DEVICE)
    positions = torch.tensor([0, 5, 300, 511, 17], device=DEVICE)
    # q and k side by side, a strided view into a fused qkv projection (as the model passes them)
    qkv = torch.randn(5, 10 * head_dim, device=DEVICE, dtype=dtype)
    qk = qkv[:, : 8 * head_dim].view(5, 8, head_dim)
    ref = rope(positions, qk)
    use_fused_kernels(rope, True)
    close(rope(positions, qk), ref, dtype)
    close(rope(positions, qk.contiguous()), ref, dtype)


def qk_norm_rope_reference(qk, cos, sin, q_weight, k_weight, eps, num_q_heads):
    """The model's plain-torch path: RMSNorm of each head with q's or k's weight, then the rotation."""
    weight = torch.cat([q_weight.expand(num_q_heads, -1), k_weight.expand(qk.shape[1] - num_q_heads, -1)])
    return _rotate(rms_norm(qk, weight, eps), cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_k_heads,head_dim", [(4, 2, 64), (2, 1, 128), (2, 2, 96)])
def test_qk_norm_rope(dtype, num_q_heads, num_k_heads, head_dim):
    """q and k side by side in a strided view of the fused qkv projection (as the model passes them), cos and
    sin as the model's lookup gives them (halves of one [T, D] row), against the plain-torch norm + rotation."""
    torch.manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 5, 300, 511, 17], device=DEVICE)
    heads = num_q_heads + num_k_heads
    qkv = torch.randn(5, (heads + num_k_heads) * head_dim, device=DEVICE, dtype=dtype) * 3
    qk = qkv[:, : heads * head_dim].view(5, heads, head_dim)
    cos, sin = rope.lookup(positions, dtype)
    q_weight, k_weight = torch.randn(2, head_dim, device=DEVICE, dtype=dtype)
    ref = qk_norm_rope_reference(qk, cos, sin, q_weight, k_weight, 1e-6, num_q_heads)
    out = fused_kernels.qk_norm_rope(qk, cos, sin, q_weight, k_weight, 1e-6, num_q_heads)
    assert out.shape == qk.shape and out.is_contiguous()
    close(out, ref, dtype)
    compiled = torch.compile(lambda *a: torch.ops.kiln.qk_norm_rope(*a) * 2, fullgraph=True, dynamic=True)
    close(compiled(qk, cos, sin, q_weight, k_weight, 1e-6, num_q_heads), 2 * ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(9, 2 * 1500, device=DEVICE, dtype=dtype)  # more than one 1024-wide block per row
    close(fused_kernels.silu_and_mul(x), silu_and_mul(x), dtype)


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    assert fused_kernels.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused_kernels.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


def test_rotate_in_place_matches_the_plain_rotation():
    rope = RotaryEmbedding(16, 64, 10000.0, None).to(DEVICE)
    cos, sin = rope.lookup(torch.tensor([0, 9, 63], device=DEVICE), torch.float32)
    y = torch.randn(3, 5 * 16, device=DEVICE)
    heads = y[:, : 3 * 16].unflatten(1, (3, 16))  # a strided view: the first three heads of each row
    ref = torch.cat([_rotate(heads, cos, sin).flatten(1), y[:, 48:]], dim=1)
    fused_kernels.rotate(heads, cos, sin, out=heads)
    close(y, ref, torch.float32)


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_equals_the_chain_without(monkeypatch):
    """One-row matmuls (plain, SiLU-and-mul, rotary, with the norm inside), norms and rotations back to back in one
    CUDA graph, each reading the one before's output: launched with programmatic dependent launch, a load placed
    before its wait would read a stale value. Bit-for-bit the same chain without PDL (the same kernels, launched
    plainly)."""

    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setattr(gemv, "NORM_MAX_K", 1 << 30)  # the norm inside the matmul at this K too
    torch.manual_seed(0)
    hidden, head_dim = 2048, 64
    dev, dt = "cuda", torch.bfloat16
    square = [torch.randn(hidden, hidden, device=dev, dtype=dt) / hidden**0.5 for _ in range(3)]
    gate_up = torch.randn(2 * hidden, hidden, device=dev, dtype=dt) / hidden**0.5
    norm_w = torch.randn(hidden, device=dev, dtype=dt)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(dev)
    cos, sin = rope.lookup(torch.tensor([1234], device=dev), dt)
    x0 = torch.randn(1, hidden, device=dev, dtype=dt)

    def chain():
        x, residual = x0, torch.zeros_like(x0)
        for _ in range(4):
            x, residual = fused_kernels.rms_norm(x, norm_w, 1e-6, residual)
            x = gemv.gemv_rope(x, square[0], None, cos, sin, hidden // 2)
            x = fused_kernels.rotate(x.view(1, -1, head_dim), cos, sin).view(1, hidden)
            x, residual = gemv.add_norm_linear(x, residual, norm_w, 1e-6, square[1])
            x, residual = gemv.add_norm_linear(x, residual, norm_w, 1e-6, gate_up, epilogue="silu_mul")
            x = gemv.gemv_silu_mul(fused_kernels.silu_and_mul(torch.cat([x, x], dim=1)), gate_up)
            x = gemv.gemv(x, square[2])
        return x

    outs = {}
    for on in (True, False):
        monkeypatch.setattr(environment, "ENV", dataclasses.replace(environment.ENV, pdl=on))
        chain()  # compile the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[on] = out.clone()
    assert torch.isfinite(outs[True]).all()
    assert torch.equal(outs[True], outs[False])


def test_decode_kernels_do_not_spill_registers_on_the_h200():
    """The decode path's kernels (decode attention, the one-row matmuls with their epilogues, Qwen3's q/k norm +
    rotary) compiled for sm_90 by Triton on this machine: none may spill registers to local memory — a spill made
    6d67307's decode kernel 1.5x slower on long contexts (`scripts/dev/kernel_resources.py`) — but the decode kernel's
    few-request config, measured faster in the step with its small spill (`FEW_SPILL_ALLOWED`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "dev" / "kernel_resources.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def kernel_resources(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600
        )

    run = kernel_resources("--families", "decode,gemv,qk_norm_rope", "--check")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # three models x (3 configs at one split + 2 at 64: the large-grid one never runs split)
    assert run.stdout.count(" decode ") == 15 and "spills" not in run.stdout, run.stdout
    # the unified (prefill) kernel's pages loaded an iteration ahead let Triton keep more than one K/V tile in flight
    # (BUF, the last column); it is off the decode path, so a small spill of its 16-row build is not refused here
    run = kernel_resources("--families", "prefill")
    # a table row names the kernel in its second column (the closing "spills:" line names them too)
    prefill = [line for line in run.stdout.splitlines() if line.split()[1:2] == ["prefill"]]
    assert len(prefill) == 6 and all(int(line.split()[-1]) >= 1 for line in prefill), run.stdout
