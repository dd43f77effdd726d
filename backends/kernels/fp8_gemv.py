"""The one-row matmul of an FP8 linear layer: y = dequant(x) @ dequant(W)^T (+ b) for x [1, K], W e4m3 [N, K].

A batch-1 decode step reads every weight once, so FP8 weights halve its bytes. Each program reads BLOCK_N weight rows
in BLOCK_K chunks, as the 16-bit one-row matmul does (gemv.py), converts them to float32 in registers and dots them
with x rounded through e4m3 as the layer's activations say (`kiln::fp8_linear`, fp8.py): by its static scale, by the
row's largest |x| / 448 (a first pass over x, which every program reads: K values), or by each BLOCK_K group's.
A scale per output row multiplies the sum once; a scale per weight block multiplies each chunk's partial sum (the
chunk is then one block wide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels import pdl
from kiln.backends.kernels.gemv import epilogue_rows, store_outputs

FP8_MAX = tl.constexpr(448.0)  # (a global a kernel reads must be a constexpr)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # (fp8.py's INV_FP8_MAX: scales are products)


@triton.jit
def _e4m3_units(x, scale, HARDWARE: tl.constexpr = False):
    """x / scale rounded to the nearest e4m3 value (ties to even, saturated at 448), as float32. HARDWARE (a GPU's
    kernel): the conversion instruction and back. Else in float32 arithmetic: three mantissa bits kept of a normal
    value (a carry moves the exponent, as it must), multiples of 2^-9 below 2^-6 (e4m3's subnormals); the same in
    Triton's interpreter, whose e4m3 conversion drops such a carry, at ten instructions a value.
    x / scale is x times the reciprocal of scale (fp8.py's `quantize_activations` too), the reciprocal IEEE-rounded
    (`div_rn`): Triton's `/` is not, and a quotient an ulp away from torch's can round to another e4m3 value."""
    v = tl.clamp(x * tl.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
    if HARDWARE:
        rounded = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # (-1048576: 0xFFF00000, the low 20 bits cleared)
        normal = bits.to(tl.float32, bitcast=True)
        subnormal = (v + 24576.0) - 24576.0  # (1.5 * 2^14: float32's rounding to multiples of 2^-9)
        rounded = tl.where(tl.abs(v) < 0.015625, subnormal, normal)
    return rounded


@triton.jit
def _round_e4m3(x, scale, HARDWARE: tl.constexpr = False):
    """x rounded through e4m3 at `scale` (`_e4m3_units` times scale)."""
    return _e4m3_units(x, scale, HARDWARE) * scale


@triton.jit
def _x_chunk(x_ptr, k0, offs_k, K, x_scale, ACT: tl.constexpr, HW_ROUND: tl.constexpr):
    """x's chunk at k0 in float32, rounded through e4m3 as ACT says (a "group" chunk by its own largest |x|)."""
    x = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
    if ACT == "group":
        x = _round_e4m3(x, tl.maximum(tl.max(tl.abs(x), axis=0) * INV_FP8_MAX, 1.1754943508222875e-38), HW_ROUND)
    elif ACT != "none":
        x = _round_e4m3(x, x_scale, HW_ROUND)
    return x


@triton.jit
def _chunk_dot(
    w, x, w_scale_ptr, rows, k0, stride_scale, BLOCKED: tl.constexpr, SCALE_ROWS: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The rows' dot products with a chunk, each times its block's scale when the layer has a scale a block."""
    part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if BLOCKED:
        part *= tl.load(w_scale_ptr + (rows // SCALE_ROWS) * stride_scale + k0 // BLOCK_K)
    return part


@triton.jit
def _fp8_gemv_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    w_scale_ptr,
    in_scale_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    N,
    K,
    stride_wn,
    stride_scale,  # a row of block scales (BLOCKED)
    ROT_ROWS,
    ACT: tl.constexpr,  # "none", "static", "token", "group"
    BLOCKED: tl.constexpr,  # a scale per (SCALE_ROWS x BLOCK_K) block, else per row
    SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,  # "", "silu_mul" or "rope", as the 16-bit one-row matmul's (gemv.py)
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HW_ROUND: tl.constexpr,  # the GPU's e4m3 conversion (`_round_e4m3`); not under the interpreter
    USE_PDL: tl.constexpr,
):
    """A program dots BLOCK_N weight rows with x, or with an epilogue BLOCK_N pairs of rows: "silu_mul", gate row i
    and up row N + i; "rope", rows j and j + HALF of a head, rotated as neox RoPE by cos, sin [HALF] when the head's
    rows lie below ROT_ROWS (q, k); each rounded as the plain form (gemv.py's `store_outputs`)."""
    idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = idx < N
    clamped = tl.minimum(idx, N - 1)  # (rows past N re-read row N-1: full-width loads)
    rows_a, rows_b = epilogue_rows(clamped, N, HALF, EPILOGUE)
    offs_k = tl.arange(0, BLOCK_K)
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    # the first chunk of the weights before waiting on the previous kernel (`kiln.backends.kernels.pdl`): no
    # kernel writes them
    k_ok = offs_k < K
    wa = tl.load(wa_ptrs, mask=k_ok[None, :], other=0.0)
    if EPILOGUE != "":
        wb = tl.load(wb_ptrs, mask=k_ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_scale = 1.0
    if ACT == "static":
        x_scale = tl.load(in_scale_ptr).to(tl.float32)
    elif ACT == "token":
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            chunk = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(chunk))
        x_scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, 1.1754943508222875e-38)
    x = _x_chunk(x_ptr, 0, offs_k, K, x_scale, ACT, HW_ROUND)
    acc_a = _chunk_dot(wa, x, w_scale_ptr, rows_a, 0, stride_scale, BLOCKED, SCALE_ROWS, BLOCK_K)
    if EPILOGUE != "":
        acc_b = _chunk_dot(wb, x, w_scale_ptr, rows_b, 0, stride_scale, BLOCKED, SCALE_ROWS, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = _x_chunk(x_ptr, k0, offs_k, K, x_scale, ACT, HW_ROUND)
        wa = tl.load(wa_ptrs + k0, mask=k_ok[None, :], other=0.0)
        acc_a += _chunk_dot(wa, x, w_scale_ptr, rows_a, k0, stride_scale, BLOCKED, SCALE_ROWS, BLOCK_K)
        if EPILOGUE != "":
            wb = tl.load(wb_ptrs + k0, mask=k_ok[None, :], other=0.0)
            acc_b += _chunk_dot(wb, x, w_scale_ptr, rows_b, k0, stride_scale, BLOCKED, SCALE_ROWS, BLOCK_K)
    if not BLOCKED:
        acc_a *= tl.load(w_scale_ptr + rows_a)
        if EPILOGUE != "":
            acc_b *= tl.load(w_scale_ptr + rows_b)
    if EPILOGUE == "":
        acc_b = acc_a  # (not read: `store_outputs` takes one name for both forms)
    store_outputs(
        y_ptr,
        b_ptr,
        idx,
        clamped,
        rows_a,
        rows_b,
        acc_a,
        acc_b,
        cos_ptr,
        sin_ptr,
        ROT_ROWS,
        mask_n,
        HALF,
        HAS_BIAS,
        EPILOGUE,
    )


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    activations: str,
    config: tuple[int, int, int] | None = None,
    epilogue: str = "",
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rot_rows: int = 0,
) -> torch.Tensor:
    """x [1, K] (or [K]) through the FP8 layer: [1, N] in x's dtype; with `epilogue` "silu_mul", silu(gate) * up of
    a gate/up layer ([1, N / 2]); with "rope", neox RoPE by cos, sin [.., D/2] (this token's row) on the first
    rot_rows outputs ([1, N]). `config`: (BLOCK_N, BLOCK_K, num_warps), BLOCK_N pairs of rows with an epilogue; a
    block-scaled layer's BLOCK_K is its block's columns (so a chunk has one scale a row)."""
    n, k = weight.shape
    x = x.reshape(k).contiguous()
    # (scripts/dev/sweep_fp8_gemv.py at Llama-3.1-8B's and Llama-3.2-1B's layers: with activations rounded, 16 rows
    # a program share each chunk's rounding, in chunks of 2,048 and 8 warps; without, 4 rows and 4 warps; an
    # epilogue's pairs, half as many)
    block_rows, chunk, warps = config or ((16, min(2048, k), 8) if activations != "none" else (4, min(1024, k), 4))
    if epilogue and config is None:
        block_rows = max(1, block_rows // 2)
    if block_n or activations == "group":
        chunk = block_k
    chunk = triton.next_power_of_2(chunk)
    if (block_n or activations == "group") and chunk != block_k:
        raise ValueError(f"an FP8 block of {block_k} columns is not a power of two")
    half = cos.shape[-1] if epilogue == "rope" else 1
    pairs = n // 2 if epilogue else n  # the kernel's N: outputs, or pairs of rows
    y = torch.empty(1, n // 2 if epilogue == "silu_mul" else n, dtype=x.dtype, device=x.device)
    if epilogue == "rope":
        assert n % (2 * half) == 0 and rot_rows % (2 * half) == 0 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    _fp8_gemv_kernel[(triton.cdiv(pairs, block_rows),)](
        y,
        x,
        weight,
        weight_scale,
        input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale,
        cos if cos is not None else weight_scale,
        sin if sin is not None else weight_scale,
        pairs,
        k,
        weight.stride(0),
        weight_scale.stride(0),
        rot_rows,
        ACT=activations,
        BLOCKED=block_n > 0,
        SCALE_ROWS=max(block_n, 1),
        HAS_BIAS=bias is not None,
        EPILOGUE=epilogue,
        HALF=half,
        BLOCK_N=block_rows,
        BLOCK_K=chunk,
        HW_ROUND=x.is_cuda,
        num_warps=warps,
        **pdl.launch_kwargs(x),
    )
    return y
