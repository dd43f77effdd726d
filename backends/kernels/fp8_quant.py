"""Activations to e4m3 for `torch._scaled_mm` and the block-scaled matmul (fp8.py), in one launch: each row of
x [M, K] divided by its scale (its largest |x| / 448, the layer's static input scale, or each group of columns'
largest |x| / 448) and rounded to e4m3, with the scales beside it.
torch's ops make this six elementwise kernels a layer (abs, amax, the scale, the division, the clamp, the cast);
here a program reads its row twice (the largest |x|, then the values) and writes it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.fp8_gemv import INV_FP8_MAX, _e4m3_units


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    in_scale_ptr,
    K,
    stride_x,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HW_ROUND: tl.constexpr,  # the GPU's e4m3 conversion (`_e4m3_units`); not under the interpreter
    GROUPED: tl.constexpr = False,  # a scale a row and BLOCK_K columns (scale_ptr [M, K / BLOCK_K])
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_x
    if GROUPED:  # each group read once: its largest |x|, its scale, its values
        num_groups = tl.cdiv(K, BLOCK_K)
        for g in range(0, num_groups):
            ok = g * BLOCK_K + offs < K
            x = tl.load(x_row + g * BLOCK_K + offs, mask=ok, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) * INV_FP8_MAX, 1.1754943508222875e-38)
            tl.store(q_ptr + row * K + g * BLOCK_K + offs, _e4m3_units(x, scale, HW_ROUND).to(tl.float8e4nv), mask=ok)
            tl.store(scale_ptr + row * num_groups + g, scale)
    else:
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                chunk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(chunk))
            scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, 1.1754943508222875e-38)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k0 + offs, _e4m3_units(x, scale, HW_ROUND).to(tl.float8e4nv), mask=ok)
        tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [M, K], float32 scales [M, 1]) of a 2-D x: a scale a row from its values, or `input_scale`'s one
    value for every row (a static scale)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_rows_kernel[(m,)](
        x,
        q,
        scale,
        input_scale if input_scale is not None else scale,
        k,
        x.stride(0),
        STATIC=input_scale is not None,
        BLOCK_K=min(2048, triton.next_power_of_2(k)),
        HW_ROUND=x.is_cuda,
        num_warps=4,
    )
    return q, scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [M, K], float32 scales [M, K / group]) of a 2-D x: a scale a row and `group` columns (a power of two),
    the activations of a block-scaled layer."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_rows_kernel[(m,)](
        x, q, scale, scale, k, x.stride(0), STATIC=False, BLOCK_K=group, HW_ROUND=x.is_cuda, GROUPED=True, num_warps=4
    )
    return q, scale
