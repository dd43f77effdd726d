"""Fused Triton kernels against the layers' plain-torch forms (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kiln.backends import fused_kernels
from kiln.engine.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, use_fused_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


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
@pytest.mark.parametrize("head_dim,scaling", [(64, None), (128, {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})])  # fmt: skip
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    act = SiluAndMul()
    x = torch.randn(9, 2 * 1500, device=DEVICE, dtype=dtype)  # more than one 1024-wide block per row
    ref = act(x)
    use_fused_kernels(act, True)
    close(act(x), ref, dtype)


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    assert fused_kernels.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused_kernels.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
