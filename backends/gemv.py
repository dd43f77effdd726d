"""One-row matmuls: `y = x @ W.T (+ b)` for x [1, K], the linear layers of a batch-1 decode step.

A batch-1 decode step reads every weight once and does two flops per byte, so its speed is how close
each matmul comes to the memory bandwidth. cuBLAS's kernels for one row reach 8-60% of the H200's
bandwidth on the 0.6-1B models' layer shapes and 59-98% on the 8B's (`scripts/bench_gemv.py`,
BENCHMARKS.md): 12.6 µs for Qwen3-0.6B's 4 MB o_proj, and a split-K matmul plus its reduce and two
copies for a down projection. Here each program reads BLOCK_N whole weight rows in BLOCK_K chunks and
dots them with x, accumulating in float32; no split-K, so one kernel a matmul. It beat cuBLAS on all
twelve layer shapes of the three presets measured (by 3-75%).

With more rows it does not: a [BLOCK_M, BLOCK_N, BLOCK_K] product tile in registers was slower than
cuBLAS from 2 rows on the larger shapes and at 8 rows 1.2-4.7x slower even at its best config, where
cuBLAS's time has not yet grown (the same sweep). So `kiln::linear`, the op the model's Linear layers
call on CUDA, takes this kernel for exactly one row and `F.linear` for the rest. It is opaque to
Dynamo (the compiled pieces call it as an extern, as they do cuBLAS) and decides per call on the host,
so each CUDA graph records the kernel of its own size.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# KILN_GEMV=0 sends every matmul to cuBLAS (for A/B benchmarks); read once, at import
ENABLED = os.environ.get("KILN_GEMV", "1") != "0"


@triton.jit
def _gemv_kernel(y_ptr, x_ptr, w_ptr, b_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # NOTE: rows past N re-read row N-1 rather than masking, so every weight load is a full-width vector
    w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            mask_k = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=mask_k[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=mask_k, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def default_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): a K chunk of up to 2,048, and rows enough for a 4,096-weight tile
    up to K = 2,048, one row beyond. The best or within 2% of the best of 38 configs on each of the 12
    shapes of `bench_gemv.py --sweep` on the H200 (K = 1,024: 4 x 1,024; K = 2,048: 2 x 2,048; K from
    3,072 to 14,336: 1 x 2,048)."""
    return max(1, 4096 // triton.next_power_of_2(k)), min(2048, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """x [K] or [1, K] (contiguous) times weight [N, K] (rows contiguous) transposed: [1, N]."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert x.numel() == k and x.is_contiguous() and weight.shape[1] == k and weight.stride(1) == 1
    block_n, block_k, num_warps = config or default_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        y, x, weight, bias if bias is not None else weight, n, k, weight.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim of x; by the one-row kernel when x is a single contiguous row."""
    if ENABLED and x.numel() == x.shape[-1] > 0 and x.is_contiguous() and weight.stride(-1) == 1:
        return gemv(x, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# NOTE: registered on a plain Library rather than with `torch.library.custom_op`, whose Python wrapper costs
# ~25 µs a call more (measured on the CPU machine): the compiled pieces call this op four times a layer.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.impl("linear", linear, "CPU")
_lib.impl("linear", linear, "CUDA")


@torch.library.register_fake("kiln::linear", lib=_lib)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
