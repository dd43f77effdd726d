"""The matmul of a block-scaled FP8 layer past one row (Hugging Face's fine-grained FP8 and compressed-tensors'
FP8_BLOCK: a scale per 128 x 128 weight block, activations per token and 128 columns): y = x @ W^T (+ b) with x
rounded to e4m3 a group at a time (fp8_quant.py `quantize_groups`) and W e4m3 [N, K].

Each program computes a BLOCK_M x BLOCK_N tile over K in steps of one scale group (BLOCK_K = the block's columns):
a step's dot of e4m3 tiles (on the GPU's FP8 tensor cores; in float32 under the interpreter, and for blocks
narrower than the tensor cores' K of 32) times its rows'
activation scales and its columns' weight-block scales, summed in float32. The same arithmetic as the reference
(fp8.py `fp8_linear_reference`: dequantize both, one float32 matmul) up to the order of the sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_matmul_kernel(
    y_ptr,
    a_ptr,  # [M, K] e4m3
    a_scale_ptr,  # [M, K / BLOCK_K]
    w_ptr,  # [N, K] e4m3
    w_scale_ptr,  # [N / SCALE_ROWS, K / BLOCK_K]
    b_ptr,
    M,
    N,
    K,
    stride_ws,
    SCALE_ROWS: tl.constexpr,  # rows of a weight block
    HAS_BIAS: tl.constexpr,
    FP8_DOT: tl.constexpr,  # the tensor cores' e4m3 dot (a GPU, BLOCK_K >= 32), else float32 (the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    groups = tl.cdiv(K, BLOCK_K)
    # 32-bit offsets (a layer's weights and a step's activations have fewer than 2**31 elements; the caller checks):
    # 64-bit ones for two tiles of pointers cost the registers of a third accumulator, and spill
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    a_scales = a_scale_ptr + offs_m * groups
    w_scales = w_scale_ptr + (offs_n // SCALE_ROWS) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        k_ok = g * BLOCK_K + offs_k < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(a, w)
        else:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        a_s = tl.load(a_scales + g, mask=m_ok, other=0.0)
        w_s = tl.load(w_scales + g, mask=n_ok, other=0.0)
        acc += part * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [.., K] through a block-scaled FP8 layer (blocks of block_n x block_k, block_k a power of two of at least
    16): [.., N] in x's dtype. `config`: (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    from kiln.backends.kernels.fp8_quant import quantize_groups  # noqa: PLC0415

    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    assert max(m, n) * k < 2**31, "the kernel's offsets are 32-bit"
    xq, x_scale = quantize_groups(x2, block_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # (8 warps at 64 x 128: it spills less than with 4; kernel_resources.py --families fp8_block shows both)
    block_m, block_n_tile, warps, stages = config or ((64, 128, 8, 3) if m > 64 else (16, 128, 4, 4))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile))
    _block_fp8_matmul_kernel[grid](
        y,
        xq,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else y,
        m,
        n,
        k,
        weight_scale.stride(0),
        SCALE_ROWS=block_n,
        HAS_BIAS=bias is not None,
        FP8_DOT=x.is_cuda and block_k >= 32,  # (the FP8 tensor cores take K 32 at a time; 16 x 16 blocks are tests')
        BLOCK_M=block_m,
        BLOCK_N=block_n_tile,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y.view(*x.shape[:-1], n)
