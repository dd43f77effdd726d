"""Matmuls with a few rows: `y = x @ W.T (+ b)` for x [M <= 8, K], the linear layers of a small-batch decode.

A batch-1 decode step reads every weight once and does two flops per byte, so its speed is how close
each matmul comes to the memory bandwidth. cuBLAS's kernels for M = 1..8 on the layer shapes of the
0.6-1B models reach 30-60% of it (BENCHMARKS.md, the batch-1 kernel profiles: 5-12 µs for a 4-12 MB
weight, a split-K matmul plus its reduce and two copies for a down projection). Here each program reads
BLOCK_N whole weight rows in BLOCK_K chunks and multiplies them with all M rows of x (which stay in
cache), accumulating in float32; no split-K, so one kernel a matmul.

`kiln::linear` is the registered op the model's Linear layers call on CUDA: opaque to Dynamo (so the
compiled pieces call it as an extern, like cuBLAS), it takes this kernel for M <= MAX_ROWS and
`F.linear` otherwise. The choice is made per call on the host, so a CUDA graph records the kernel of its
own size.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 8
# KILN_SKINNY_GEMM=0 sends every matmul to cuBLAS (for A/B benchmarks); read once, at import
ENABLED = os.environ.get("KILN_SKINNY_GEMM", "1") != "0"


@triton.jit(do_not_specialize=["M"])
def _skinny_mm_kernel(y_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    # NOTE: rows past N re-read row N-1 rather than masking: every load stays a full-width vector
    w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            mask_k = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=mask_k[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=mask_k[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [k, n] product: enough programs to give every SM
    several (n / BLOCK_N of them), and a K chunk that keeps the float32 products of a program's tile
    within its registers (BLOCK_M * BLOCK_N * BLOCK_K of them)."""
    block_m = triton.next_power_of_2(m)
    block_n = max(1, min(16, 1 << max(0, (n // 512).bit_length() - 1)))
    block_k = min(triton.next_power_of_2(k), max(64, 8192 // (block_m * block_n)))
    return block_n, block_k, 4


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] (M <= MAX_ROWS, rows may be strided) times weight [N, K] (rows contiguous) transposed."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    block_n, block_k, num_warps = config or default_config(m, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_mm_kernel[(triton.cdiv(n, block_n),)](
        y, x, weight, bias if bias is not None else weight, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, num_warps=num_warps,
    )  # fmt: skip
    return y


@torch.library.custom_op("kiln::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim of x, by the skinny kernel when there are at most MAX_ROWS rows."""
    rows = x.reshape(-1, x.shape[-1])
    if ENABLED and 0 < rows.shape[0] <= MAX_ROWS and rows.stride(-1) == 1 and weight.stride(-1) == 1:
        return skinny_matmul(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
