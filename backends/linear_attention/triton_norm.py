"""Gated DeltaNet's output norm in Triton: RMSNorm of each head's output, gated by SiLU(z).

It rounds as transformers' `Qwen3_5RMSNormGated` does: the normalised row (float32) is cast to x's dtype before the
weight multiplies it, and the gate is applied in float32 before the last cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_ELEMENTS = 2048  # a program's rows x D: several 128-wide heads at once


@triton.jit
def _gated_rms_norm_kernel(
    out_ptr,
    x_ptr,
    z_ptr,
    weight_ptr,
    eps,
    num_rows,
    stride_x,
    stride_z,
    stride_o,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,  # weight * normed rounds to x's dtype (as torch's bf16 * bf16), not float32
):
    offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    mask = (offs_n < num_rows)[:, None] & d_mask[None, :]
    rows = offs_n[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_x + offs_d[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 1) / D + eps)
    weight = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    # (16-bit products made explicit: float32 math, then the rounding torch's would do)
    y = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32) * weight[None, :]
    if ROUND_PRODUCT:
        y = y.to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + rows * stride_z + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    gated = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows * stride_o + offs_d[None, :], gated.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x), times silu(z): x, z [N, D] (rows may be strided, D contiguous), weight [D]; a new
    [N, D] tensor in x's dtype."""
    num_rows, dim = x.shape
    assert x.stride(1) == 1 and z.stride(1) == 1 and z.shape == x.shape
    out = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device)
    block_d = triton.next_power_of_2(dim)
    rows = max(1, ROW_ELEMENTS // block_d)
    if num_rows:
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            out,
            x,
            z,
            weight,
            eps,
            num_rows,
            x.stride(0),
            z.stride(0),
            out.stride(0),
            D=dim,
            BLOCK_D=block_d,
            ROWS=rows,
            ROUND_PRODUCT=torch.promote_types(x.dtype, weight.dtype) != torch.float32,
            num_warps=4,
        )
    return out
