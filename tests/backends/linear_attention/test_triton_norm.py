"""The gated RMSNorm's Triton kernel against a float64 reference and transformers' `Qwen3_5RMSNormGated`, under
Triton's interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

from kiln.backends.linear_attention.triton_norm import gated_rms_norm

from helpers.kernels import DEVICE


def reference(x, z, weight, eps):
    x, z, weight = x.double(), z.double(), weight.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed * torch.nn.functional.silu(z)


@pytest.mark.parametrize("num_rows,dim", [(1, 32), (37, 128), (5, 48)])
def test_gated_rms_norm_float32(num_rows, dim):
    """One row, rows past one program's block, a width that is not a power of two; x and z strided views."""
    torch.manual_seed(num_rows)
    xz = torch.randn(num_rows, 2 * dim + 8, device=DEVICE)
    x, z = xz[:, :dim], xz[:, dim + 8 :]
    weight = torch.randn(dim, device=DEVICE)
    out = gated_rms_norm(x, z, weight, 1e-6)
    assert out.shape == (num_rows, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, z, weight, 1e-6), atol=1e-5, rtol=1e-5)


def bfloat16_inputs(num_rows, dim, device):
    torch.manual_seed(0)
    x = torch.randn(num_rows, dim, device=device).bfloat16()
    z = torch.randn(num_rows, dim, device=device).bfloat16()
    module = Qwen3_5RMSNormGated(dim, eps=1e-6).to(device, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim))
    return x, z, module


def test_gated_rms_norm_bfloat16():
    """bf16 (the model dtype), within bf16 rounding of float64 (the interpreter's casts to bf16 truncate: the
    rounding as transformers' is checked on the GPU, below)."""
    x, z, module = bfloat16_inputs(24, 64, DEVICE)
    out = gated_rms_norm(x, z, module.weight.detach(), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(x, z, module.weight.detach(), 1e-6), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gated_rms_norm_rounds_as_transformers():
    """On the GPU, at Qwen3.6's head width: as close to float64 as transformers' module (both cast the normalised row to
    bf16 before the weight; their rsqrt and exp differ in the last float32 bits, which may move one of those roundings),
    and never more than a few bf16 roundings from it."""
    x, z, module = bfloat16_inputs(4096, 128, "cuda")
    out = gated_rms_norm(x, z, module.weight.detach(), 1e-6)
    with torch.no_grad():
        want = module(x, z)
    exact = reference(x, z, module.weight.detach(), 1e-6)
    assert (out.double() - exact).abs().max() <= 1.5 * (want.double() - exact).abs().max()
    ulp = want.float().abs().clamp_min(1e-3) * 2**-7
    assert ((out.float() - want.float()).abs() <= 4 * ulp).all()
