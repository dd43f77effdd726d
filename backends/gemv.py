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

from kiln.backends import fused_kernels

# KILN_GEMV=0 sends every matmul to cuBLAS (for A/B benchmarks); read once, at import
ENABLED = os.environ.get("KILN_GEMV", "1") != "0"


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:  # a full-width vector load, no mask
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _gemv_kernel(y_ptr, x_ptr, w_ptr, b_ptr, residual_ptr, residual_out_ptr, norm_w_ptr, eps, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr):  # fmt: skip
    """y[n] = sum_k W[n, k] x'[k] for BLOCK_N rows n, where x' is x; with NORM, RMSNorm(x + residual) with
    its weight (program 0 also writes x + residual); with SILU_MUL, silu(x[k]) * x[K + k]."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # NOTE: rows past N re-read row N-1 rather than masking, so every weight load is a full-width vector
    w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = _load(x_ptr + k0 + offs_k, mask_k, EVEN_K)
        if NORM:
            # The norm's scale 1/rms is common to the whole row: the dot takes x * weight, and the sum of
            # squares comes along for the scale applied at the end (so one pass, no second read of x)
            if HAS_RESIDUAL:
                x = x + _load(residual_ptr + k0 + offs_k, mask_k, EVEN_K)  # rounded as torch's add is
                if pid == 0:
                    tl.store(residual_out_ptr + k0 + offs_k, x, mask=mask_k)
            x32 = x.to(tl.float32)
            sum_sq += x32 * x32
            x32 = x32 * _load(norm_w_ptr + k0 + offs_k, mask_k, EVEN_K).to(tl.float32)
        elif SILU_MUL:
            gate = x.to(tl.float32)
            x32 = gate / (1.0 + tl.exp(-gate)) * _load(x_ptr + K + k0 + offs_k, mask_k, EVEN_K).to(tl.float32)
        else:
            x32 = x.to(tl.float32)
        w = _load(w_ptrs + k0, mask_k[None, :], EVEN_K)
        acc += tl.sum(w.to(tl.float32) * x32[None, :], axis=1)
    if NORM:
        acc = acc / tl.sqrt(tl.sum(sum_sq, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def default_config(n: int, k: int, variant: str = "plain") -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). Plain: a K chunk of up to 2,048, and rows enough for a 4,096-weight
    tile up to K = 2,048, one row beyond. The best or within 2% of the best of 38 configs on each of the 12
    shapes of `bench_gemv.py --sweep` on the H200 (K = 1,024: 4 x 1,024; K = 2,048: 2 x 2,048; K from
    3,072 to 14,336: 1 x 2,048). The fused forms ("norm", "silu") work on each x chunk before the dot, once
    per program: more rows a program share that work."""
    if variant == "plain":
        return max(1, 4096 // triton.next_power_of_2(k)), min(2048, triton.next_power_of_2(k)), 4
    return 8, min(512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """x [K] or [1, K] (contiguous) times weight [N, K] (rows contiguous) transposed: [1, N]."""
    return _launch(x, weight, bias, config)


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`gemv(rms_norm(x + residual))` in one kernel, and x + residual (None without a residual)."""
    residual_out = torch.empty_like(x) if residual is not None else None
    y = _launch(x, weight, bias, config, norm_weight, eps, residual, residual_out)
    return y, residual_out


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """`gemv(silu(gate) * up)` in one kernel, for gate_up [1, 2K] = gate | up."""
    return _launch(gate_up, weight, bias, config, silu_mul=True)


def _launch(x, weight, bias, config, norm_weight=None, eps=0.0, residual=None, residual_out=None, silu_mul=False):
    n, k = weight.shape
    assert x.numel() == x.shape[-1] == (2 * k if silu_mul else k) and x.is_contiguous()
    assert weight.stride(1) == 1 and (residual is None or residual.is_contiguous() and residual.numel() == k)
    variant = "norm" if norm_weight is not None else "silu" if silu_mul else "plain"
    block_n, block_k, num_warps = config or default_config(n, k, variant)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        y, x, weight, bias if bias is not None else weight, residual if residual is not None else x,
        residual_out if residual_out is not None else y, norm_weight if norm_weight is not None else weight, eps,
        n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul,
        num_warps=num_warps,
    )  # fmt: skip
    return y


def _one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ENABLED and x.numel() == x.shape[-1] > 0 and x.is_contiguous() and weight.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim of x; by the one-row kernel when x is a single contiguous row."""
    if _one_row(x, weight):
        return gemv(x, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`(F.linear(rms_norm(x + residual)), x + residual)`: one kernel for one row, the Triton norm and
    cuBLAS beyond. Without a residual the second output is empty (the caller's residual is x itself: an
    op's output may not alias its input)."""
    if _one_row(x, weight) and (residual is None or residual.is_contiguous()):
        y, residual_out = rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)
        y = y.view(*x.shape[:-1], weight.shape[0])
    elif residual is None:
        y, residual_out = F.linear(fused_kernels.rms_norm(x, norm_weight, eps), weight, bias), None
    else:
        normed, residual_out = fused_kernels.rms_norm(x, norm_weight, eps, residual)
        y = F.linear(normed, weight, bias)
    return y, residual_out if residual_out is not None else x.new_empty(0)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(silu(gate) * up)` for gate_up = gate | up on the last dim: one kernel for one row."""
    if _one_row(gate_up, weight):
        return silu_mul_gemv(gate_up, weight, bias).view(*gate_up.shape[:-1], weight.shape[0])
    return F.linear(fused_kernels.silu_and_mul(gate_up), weight, bias)


# NOTE: registered on a plain Library rather than with `torch.library.custom_op`, whose Python wrapper costs
# ~25 µs a call more (measured on the CPU machine): the compiled pieces call this op four times a layer.
_lib = torch.library.Library("kiln", "FRAGMENT")
# On the CPU they run only in the tests (Triton's interpreter): the models take the plain-torch forms there.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.define("rms_norm_linear(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, "
            "Tensor? bias=None) -> (Tensor, Tensor)")  # fmt: skip
_lib.define("silu_mul_linear(Tensor gate_up, Tensor weight, Tensor? bias=None) -> Tensor")
for _name, _fn in (("linear", linear), ("rms_norm_linear", rms_norm_linear), ("silu_mul_linear", silu_mul_linear)):
    _lib.impl(_name, _fn, "CPU")
    _lib.impl(_name, _fn, "CUDA")


@torch.library.register_fake("kiln::linear", lib=_lib)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("kiln::rms_norm_linear", lib=_lib)
def _(x, residual, norm_weight, eps, weight, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x) if residual is not None else x.new_empty(0)


@torch.library.register_fake("kiln::silu_mul_linear", lib=_lib)
def _(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])
