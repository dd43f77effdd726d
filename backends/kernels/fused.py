"""Fused eager kernels in Triton: RMSNorm with the residual add, neox RoPE, SiLU-and-mul.

They serve `--enforce-eager` on the GPU, where each would otherwise be several kernel launches and
several trips through memory. Under torch.compile the layers use their plain-torch forms instead, and
Inductor fuses those itself, except Qwen3's q/k norm + rotary, which Inductor leaves as two kernels: the
compiled pieces call `kiln::qk_norm_rope` for it. Each kernel rounds as the plain-torch form does (float32
math, the same casts), so outputs agree to within a few ulps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels import ops, pdl


@triton.jit
def _wait_for_previous_kernel():
    """With PDL (`kiln.backends.kernels.pdl`): these kernels read only what earlier kernels wrote: they wait first."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        _wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask)
    y = (x32 * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`norm(x)` or, with a residual, `(norm(x + residual), x + residual)`; rows of any leading shape."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            out,
            x2,
            r2,
            residual_out,
            weight,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            residual_out.stride(0),
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
            **pdl.launch_kwargs(x),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


@triton.jit
def _rope_kernel(
    out_ptr,
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    stride_x_t,
    stride_x_h,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    HEADS_P: tl.constexpr,
    BY_POSITION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program: one token's heads. cos, sin: the rows of a table indexed by the token's position (BY_POSITION),
    or the token's own rows."""
    if USE_PDL:
        _wait_for_previous_kernel()
    token = tl.program_id(0).to(tl.int64)
    if BY_POSITION:
        row = tl.load(positions_ptr + token).to(tl.int64)
    else:
        row = token
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HALF_P)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    cos = tl.load(cos_ptr + row * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(sin_ptr + row * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)
    x_base = x_ptr + token * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0)
    x2 = tl.load(x_base + HALF, mask=mask, other=0.0)
    cos = cos.to(x1.dtype)[None, :]
    sin = sin.to(x1.dtype)[None, :]
    o_base = out_ptr + token * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_base, x1 * cos - x2 * sin, mask=mask)
    tl.store(o_base + HALF, x2 * cos + x1 * sin, mask=mask)


def _launch_rope(
    x: torch.Tensor, out: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(2) == 1 and out.stride(2) == 1 and cos.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            out,
            x,
            positions if positions is not None else x,
            cos,
            sin,
            cos.stride(0),
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HALF=half,
            HALF_P=triton.next_power_of_2(half),
            HEADS_P=triton.next_power_of_2(num_heads),
            BY_POSITION=positions is not None,
            **pdl.launch_kwargs(x),
        )
    return out


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE of x [T, heads, D] from a float32 table cos_sin [max_pos, D] (cos half, sin half)."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch_rope(x, out, positions, cos_sin[:, :half], cos_sin[:, half:])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Neox-style RoPE of x [T, heads, D] with token t's cos[t], sin[t] ([T, D/2] rows of one stride, e.g. the
    halves of one lookup); into `out` (x itself is fine: each program reads its token's heads before writing)."""
    return _launch_rope(
        x, out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device), None, cos, sin
    )


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:
        _wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + offs, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] -> silu(x[:, :N]) * x[:, N:]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](out, x2, x2.stride(0), out.stride(0), N=n, BLOCK=block, **pdl.launch_kwargs(x))
    return out.view(*x.shape[:-1], n)


@triton.jit
def _qk_norm_rope_kernel(
    out_ptr,
    x_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    stride_x_t,
    stride_x_h,
    stride_cos,
    stride_sin,
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, head): RMSNorm of the head's row with the q or k weight, then neox RoPE of it, rounded
    as the plain-torch forms round (the norm in float32, cast, times the weight; the rotation in x's dtype)."""
    if USE_PDL:
        _wait_for_previous_kernel()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF_P)
    mask = offs < HALF
    x_row = x_ptr + token * stride_x_t + head * stride_x_h
    x1 = tl.load(x_row + offs, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
    w_ptr = tl.where(head >= NUM_Q_HEADS, k_weight_ptr, q_weight_ptr)
    y1 = (a * rstd).to(x1.dtype) * tl.load(w_ptr + offs, mask=mask, other=0.0)
    y2 = (b * rstd).to(x1.dtype) * tl.load(w_ptr + HALF + offs, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=mask, other=0.0).to(x1.dtype)
    sin = tl.load(sin_ptr + token * stride_sin + offs, mask=mask, other=0.0).to(x1.dtype)
    o_row = out_ptr + token * stride_o_t + head * stride_o_h
    tl.store(o_row + offs, y1 * cos - y2 * sin, mask=mask)
    tl.store(o_row + HALF + offs, y2 * cos + y1 * sin, mask=mask)


def qk_norm_rope(
    qk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_q_heads: int,
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of q and k (q's heads first, then k's, side by side in qk [T, heads, D], any token
    and head strides) followed by neox RoPE with cos, sin [T, D/2]: one kernel instead of a reduction and two
    pointwise passes. Returns a new contiguous [T, heads, D]."""
    num_tokens, num_heads, head_dim = qk.shape
    assert qk.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    if num_tokens:
        half = head_dim // 2
        _qk_norm_rope_kernel[(num_tokens, num_heads)](
            out,
            qk,
            cos,
            sin,
            q_weight,
            k_weight,
            eps,
            qk.stride(0),
            qk.stride(1),
            cos.stride(0),
            sin.stride(0),
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HALF=half,
            HALF_P=triton.next_power_of_2(half),
            **pdl.launch_kwargs(qk),
        )
    return out


# NOTE: an op for the compiled pieces, where Inductor makes this two kernels (a reduction that stores the
# normalised rows, then the rotation, which reads each row at two offsets).
ops.define(
    "qk_norm_rope(Tensor qk, Tensor cos, Tensor sin, Tensor q_weight, Tensor k_weight, float eps, "
    "int num_q_heads) -> Tensor",
    qk_norm_rope,
    lambda qk, *_: qk.new_empty(qk.shape),
)
