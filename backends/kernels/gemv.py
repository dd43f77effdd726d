"""One-row matmuls: `y = x @ W.T (+ b)` for x [1, K], the linear layers of a batch-1 decode step.

A batch-1 decode step reads every weight once and does two flops per byte, so its speed is how close
each matmul comes to the memory bandwidth. cuBLAS's kernels for one row fall far short of it on the small
models' layer shapes (a split-K matmul plus its reduce and two copies for a down projection). Here each
program reads BLOCK_N whole weight rows in BLOCK_K chunks and dots them with x, accumulating in float32; no
split-K, so one kernel a matmul. It beats cuBLAS on every layer shape of the presets
(`scripts/bench/bench_gemv.py`).

With more rows it does not: a [BLOCK_M, BLOCK_N, BLOCK_K] product tile in registers is slower than cuBLAS
from 2 rows on, where cuBLAS's time has not yet grown. So `kiln::linear`, the op the model's Linear layers
call on CUDA, takes this kernel for exactly one row and `F.linear` for the rest. It is opaque to
Dynamo (the compiled pieces call it as an extern, as they do cuBLAS) and decides per call on the host,
so each CUDA graph records the kernel of its own size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.backends import environment
from kiln.backends.kernels import fused as fused_kernels
from kiln.backends.kernels import ops, pdl

# The layer norm goes inside a one-row matmul up to this K: beyond it every program re-reading x, the residual and
# the norm's weight costs more than the norm kernel it saves (Qwen3-0.6B's K = 1,024 gains; 2,048 and 4,096 lose).
NORM_MAX_K = 1024


@triton.jit
def _input_chunk(x_ptr, r_ptr, nw_ptr, h_ptr, offs, mask, h_limit, EVEN_K: tl.constexpr, NORM: tl.constexpr):
    """The matmul's input at offs, in float32 [1, BLOCK_K], and with NORM the sum of squares of its h: the input is
    then rms_norm(h) * nw with h = x + r (added in x's dtype, as the plain form adds; one program stores it to
    h_ptr, the layer's new residual), of which the chunk is h * nw, and the caller scales its dot products by 1/rms
    at the end (a scalar per row: it factors out of the dot product)."""
    if EVEN_K:
        x = tl.load(x_ptr + offs)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if NORM:
        if EVEN_K:
            h = x + tl.load(r_ptr + offs)
            nw = tl.load(nw_ptr + offs)
        else:
            h = x + tl.load(r_ptr + offs, mask=mask, other=0.0)
            nw = tl.load(nw_ptr + offs, mask=mask, other=0.0)
        tl.store(h_ptr + offs, h, mask=offs < h_limit)
        h32 = h.to(tl.float32)
        return (h32 * nw.to(tl.float32))[None, :], tl.sum(h32 * h32, 0)
    else:
        return x.to(tl.float32)[None, :], 0.0


@triton.jit
def epilogue_rows(clamped, N, HALF: tl.constexpr, EPILOGUE: tl.constexpr):
    """The weight rows of output (or pair) `clamped`: with "rope" rows j and j + HALF of its head, else row i and
    row N + i (the up's row of a "silu_mul" gate row)."""
    if EPILOGUE == "rope":
        rows_a = (clamped // HALF) * (2 * HALF) + clamped % HALF
        rows_b = rows_a + HALF
    else:
        rows_a = clamped
        rows_b = clamped + N
    return rows_a, rows_b


@triton.jit
def store_outputs(
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
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """A one-row matmul's outputs from rows a's (and with an epilogue rows b's) float32 sums, plus the bias: plain;
    "silu_mul" rounded as the plain form (the matmul's output in the model's dtype, SiLU in float32, cast, times
    up); "rope" rounded as the compiled plain form (the matmul's output and cos, sin in the model's dtype, the
    rotation in float32). Without an epilogue acc_b is not read."""
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + rows_a).to(tl.float32)
        if EPILOGUE != "":
            acc_b += tl.load(b_ptr + rows_b).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    if EPILOGUE == "":
        tl.store(y_ptr + idx, acc_a.to(dtype), mask=mask_n)
    elif EPILOGUE == "silu_mul":
        gate = acc_a.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        tl.store(y_ptr + idx, silu * acc_b.to(dtype), mask=mask_n)
    else:
        x1, x2 = acc_a.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32)
        j = clamped % HALF
        cos = tl.load(cos_ptr + j).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + j).to(dtype).to(tl.float32)
        rotate = rows_a < ROT_ROWS
        y1 = tl.where(rotate, x1 * cos - x2 * sin, x1)
        y2 = tl.where(rotate, x2 * cos + x1 * sin, x2)
        tl.store(y_ptr + rows_a, y1.to(dtype), mask=mask_n)
        tl.store(y_ptr + rows_b, y2.to(dtype), mask=mask_n)


@triton.jit
def _gemv_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    r_ptr,
    nw_ptr,
    h_ptr,
    eps,
    N,
    K,
    stride_wn,
    ROT_ROWS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A program dots BLOCK_N weight rows with x, or with an epilogue BLOCK_N pairs of rows: "silu_mul", gate row
    i and up row N + i (N outputs, the gate's rows then the up's in w); "rope", rows j and j + HALF of a head (N
    pairs), rotated as neox RoPE by the token's cos, sin [HALF] when the head's rows lie below ROT_ROWS (q, k).
    With NORM the input is RMSNorm(x + r) with weight nw and eps (see `_input_chunk`)."""
    idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = idx < N
    # NOTE: rows past N re-read row N-1 rather than masking, so every weight load is a full-width vector
    clamped = tl.minimum(idx, N - 1)
    rows_a, rows_b = epilogue_rows(clamped, N, HALF, EPILOGUE)
    offs_k = tl.arange(0, BLOCK_K)
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    # The first K chunk of the weights is loaded before waiting on the previous kernel: nothing writes them.
    mask_k = offs_k < K
    if EVEN_K:
        wa = tl.load(wa_ptrs)
        if EPILOGUE != "":
            wb = tl.load(wb_ptrs)
    else:
        wa = tl.load(wa_ptrs, mask=mask_k[None, :], other=0.0)
        if EPILOGUE != "":
            wb = tl.load(wb_ptrs, mask=mask_k[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h_limit = tl.where(tl.program_id(0) == 0, K, 0)  # the first program stores h
    x, sq = _input_chunk(x_ptr, r_ptr, nw_ptr, h_ptr, offs_k, mask_k, h_limit, EVEN_K, NORM)
    acc_a = tl.sum(wa.to(tl.float32) * x, axis=1)
    if EPILOGUE != "":
        acc_b = tl.sum(wb.to(tl.float32) * x, axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x, sq_k = _input_chunk(x_ptr, r_ptr, nw_ptr, h_ptr, k0 + offs_k, mask_k, h_limit, EVEN_K, NORM)
        if NORM:
            sq += sq_k
        if EVEN_K:
            acc_a += tl.sum(tl.load(wa_ptrs + k0).to(tl.float32) * x, axis=1)
            if EPILOGUE != "":
                acc_b += tl.sum(tl.load(wb_ptrs + k0).to(tl.float32) * x, axis=1)
        else:
            acc_a += tl.sum(tl.load(wa_ptrs + k0, mask=mask_k[None, :], other=0.0).to(tl.float32) * x, axis=1)
            if EPILOGUE != "":
                wb = tl.load(wb_ptrs + k0, mask=mask_k[None, :], other=0.0)
                acc_b += tl.sum(wb.to(tl.float32) * x, axis=1)
    if NORM:
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc_a *= rstd
        if EPILOGUE != "":
            acc_b *= rstd
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


def default_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): a K chunk of up to 2,048, and rows enough for a 4,096-weight tile
    up to K = 2,048, one row beyond: the best, or within 2% of it, on every preset's layer shapes
    (`bench_gemv.py --sweep`). With an epilogue, BLOCK_N counts pairs of rows: half as many."""
    return max(1, 4096 // triton.next_power_of_2(k)), min(2048, triton.next_power_of_2(k)), 4


# (residual, norm weight, eps, h): a norm before the matmul (see `_input_chunk`), h the buffer for x + residual
Norm = tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    n: int,
    config: tuple[int, int, int] | None,
    epilogue: str = "",
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rot_rows: int = 0,
    half: int = 1,
    norm: Norm | None = None,
) -> torch.Tensor:
    k = x.shape[-1]
    assert x.numel() == k and x.is_contiguous() and weight.shape[1] == k and weight.stride(1) == 1
    block_n, block_k, num_warps = config or default_config(weight.shape[0], k)
    if epilogue and config is None:
        block_n = max(1, block_n // 2)
    residual, norm_weight, eps, h = norm if norm is not None else (x, x, 0.0, x)
    assert residual.numel() == k and residual.is_contiguous() and h.is_contiguous()
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        y,
        x,
        weight,
        bias if bias is not None else weight,
        cos if cos is not None else x,
        sin if sin is not None else x,
        residual,
        norm_weight,
        h,
        eps,
        n,
        k,
        weight.stride(0),
        rot_rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        EPILOGUE=epilogue,
        HALF=half,
        NORM=norm is not None,
        num_warps=num_warps,
        **pdl.launch_kwargs(x),
    )
    return y


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    norm: Norm | None = None,
) -> torch.Tensor:
    """x [K] or [1, K] (contiguous) times weight [N, K] (rows contiguous) transposed: [1, N]. With `norm`
    (residual, norm weight, eps, h), x is first replaced by rms_norm(x + residual) (and x + residual stored to h)."""
    n = weight.shape[0]
    return _launch(x, weight, bias, torch.empty(1, n, dtype=x.dtype, device=x.device), n, config, norm=norm)


def gemv_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int] | None = None, norm: Norm | None = None
) -> torch.Tensor:
    """silu(gate) * up of the one-row matmul with weight [2N, K] (gate's rows, then up's): [1, N], in one
    kernel (a batch-1 step's MLP without its SiLU-and-mul launch). `norm` as for `gemv`."""
    n = weight.shape[0] // 2
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    return _launch(x, weight, None, y, n, config, "silu_mul", norm=norm)


def gemv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot_rows: int,
    config: tuple[int, int, int] | None = None,
    norm: Norm | None = None,
) -> torch.Tensor:
    """The one-row qkv matmul with neox RoPE applied to its first rot_rows outputs (q's and k's heads) by cos,
    sin [.., D/2] (this token's row): [1, N], in one kernel (a batch-1 step without its rotary launch). `norm` as
    for `gemv`."""
    n, half = weight.shape[0], cos.shape[-1]
    assert n % (2 * half) == 0 and rot_rows % (2 * half) == 0 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, y, n // 2, config, "rope", cos, sin, rot_rows, half, norm=norm)


def _one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return environment.ENV.gemv and x.numel() == x.shape[-1] > 0 and x.is_contiguous() and weight.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim of x; by the one-row kernel when x is a single contiguous row."""
    if _one_row(x, weight):
        return gemv(x, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of F.linear(x, weight), weight [2N, K] the gate's rows then the up's: one kernel for one
    row; else cuBLAS and the SiLU-and-mul kernel."""
    if _one_row(x, weight):
        return gemv_silu_mul(x, weight).view(*x.shape[:-1], weight.shape[0] // 2)
    return fused_kernels.silu_and_mul(F.linear(x, weight))


def linear_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot_rows: int,
) -> torch.Tensor:
    """F.linear(x, weight, bias) [T, N] with neox RoPE on its first rot_rows columns, heads of cos.shape[-1] * 2,
    token t rotated by cos[t], sin[t]: one kernel for one row; else cuBLAS and the rotary kernel, in place."""
    if _one_row(x, weight):
        return gemv_rope(x, weight, bias, cos, sin, rot_rows).view(*x.shape[:-1], weight.shape[0])
    return rotate_leading(F.linear(x, weight, bias), cos, sin, rot_rows)


def rotate_leading(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_rows: int) -> torch.Tensor:
    """y [T, N] with neox RoPE on its first rot_rows columns (heads of cos.shape[-1] * 2), by the rotary kernel in
    place: a projection's q and k past one row."""
    rotated = y.view(-1, y.shape[-1])[:, :rot_rows].unflatten(1, (-1, 2 * cos.shape[-1]))
    fused_kernels.rotate(rotated, cos, sin, out=rotated)
    return y


def add_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    epilogue: str = "",
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rot_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual, the layer's new residual, and y the projection of rms_norm(h) * norm_weight:
    `linear` (epilogue ""), `linear_silu_mul` ("silu_mul") or `linear_rope` ("rope"). For one row of up to
    NORM_MAX_K, one kernel: a batch-1 step launches no norm. Else the add + norm kernel, then the projection."""
    if x.shape[-1] <= NORM_MAX_K and _one_row(x, weight) and residual.is_contiguous():
        h = torch.empty_like(x)
        norm = (residual, norm_weight, eps, h)
        if epilogue == "silu_mul":
            y = gemv_silu_mul(x, weight, norm=norm)
        elif epilogue == "rope":
            y = gemv_rope(x, weight, bias, cos, sin, rot_rows, norm=norm)
        else:
            y = gemv(x, weight, bias, norm=norm)
        return y.view(*x.shape[:-1], y.shape[-1]), h
    normed, h = fused_kernels.rms_norm(x, norm_weight, eps, residual)
    if epilogue == "silu_mul":
        return linear_silu_mul(normed, weight), h
    if epilogue == "rope":
        return linear_rope(normed, weight, bias, cos, sin, rot_rows), h
    return linear(normed, weight, bias), h


def _add_norm_linear_fake(x, residual, norm_weight, eps, weight, bias, epilogue, *_):
    n = weight.shape[0] // 2 if epilogue == "silu_mul" else weight.shape[0]
    return x.new_empty(*x.shape[:-1], n), torch.empty_like(x)


ops.define(
    "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    linear,
    lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0]),
)
ops.define(
    "linear_silu_mul(Tensor x, Tensor weight) -> Tensor",
    linear_silu_mul,
    lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0] // 2),
)
ops.define(
    "linear_rope(Tensor x, Tensor weight, Tensor? bias, Tensor cos, Tensor sin, int rot_rows) -> Tensor",
    linear_rope,
    lambda x, weight, *_: x.new_empty(*x.shape[:-1], weight.shape[0]),
)
ops.define(
    "add_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, Tensor? bias, "
    "str epilogue, Tensor? cos, Tensor? sin, int rot_rows) -> (Tensor, Tensor)",
    add_norm_linear,
    _add_norm_linear_fake,
)
