"""FP8 experts as two grouped Triton matmuls (the GPU form of `kiln::fused_moe_fp8`, moe_fp8.py): moe_triton.py's
plan, on e4m3 operands.

    route:   moe_routing.py, as for 16-bit experts (the pairs laid out by expert in blocks of BLOCK_M rows)
    round:   x to e4m3 with its scales (fp8_quant.py: a scale a token and block_k columns, or a token)
    gemm 1:  act[pair] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T)      in x's dtype (GELU-tanh for Gemma 4)
    round:   act to e4m3 with its scales
    gemm 2:  y[pair]   = weight[pair] * act[pair] @ down_e^T
    sum:     out[t]    = sum over its k pairs of y

In each matmul a program walks K in steps of BLOCK_K, which never straddle a scale group (BLOCK_K divides block_k):
with blocks (or groups of activations), a step's e4m3 x e4m3 dot (the FP8 tensor cores; float32 under the
interpreter) times its rows' activation scales and its columns' weight scales, summed in float32, as fp8_block.py
does for one layer; with a scale a row on both sides (`--quantization fp8`), the dots accumulate in place and the
scales come once, after the loop. A block of rows reads one expert's e4m3 weights, so a decode reads the chosen
experts' bytes and their scales, half a 16-bit expert's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.moe_routing import align, route_and_align
from kiln.backends.kernels.moe_triton import tile_config


@triton.jit
def _dot(a, w, acc, FP8_DOT: tl.constexpr):
    """a @ w (+ acc): e4m3 on the FP8 tensor cores, or float32 (the interpreter's, which has no e4m3 dot)."""
    if FP8_DOT:
        return tl.dot(a, w, acc)
    return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _grouped_fp8_matmul(
    a_ptr,  # [rows, K] e4m3: x (rows are tokens: pair // TOP_K) or act (rows are pairs)
    a_scale_ptr,  # [rows, K / GROUP_K] float32, or [rows, 1] a scale a row (stride_ask 0)
    w_ptr,  # [E, N_total, K] e4m3
    w_scale_ptr,  # [E, N_total / SCALE_N, K / GROUP_K] float32, or [E, N_total] a scale a row (stride_wsk 0)
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    up_offset,  # SILU_MUL: the up projection's first row in w (gate's rows are 0..N)
    stride_am,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    SCALE_N: tl.constexpr,  # weight rows a scale covers (1: a scale a row)
    GROUP_K: tl.constexpr,  # columns a scale covers (GROUPED), a multiple of BLOCK_K
    GROUPED: tl.constexpr,  # some scale covers GROUP_K columns, not a whole row: scaled a step at a time
    TOP_K: tl.constexpr,
    A_ROWS_ARE_TOKENS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    GELU: tl.constexpr,  # SILU_MUL's activation GELU's tanh form, not SiLU
    MUL_WEIGHT: tl.constexpr,
    FP8_DOT: tl.constexpr,  # the tensor cores' e4m3 dot (a GPU), else float32 (the interpreter; blocks under 32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // TOP_K if A_ROWS_ARE_TOKENS else pairs).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    a_scales = a_scale_ptr + rows * stride_asm
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    w_scale_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    w_scales = (w_scale_base + (offs_n // SCALE_N) * stride_wsn)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        up_ptrs = w_ptrs + up_offset * stride_wn
        up_scales = (w_scale_base + ((offs_n + up_offset) // SCALE_N) * stride_wsn)[None, :]
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SILU_MUL:
            up = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if GROUPED:  # the scales of this step's group of columns
            group = k0 // GROUP_K
            a_s = tl.load(a_scales + group * stride_ask, mask=valid, other=0.0)[:, None]
            w_s = tl.load(w_scales + group * stride_wsk, mask=n_ok[None, :], other=0.0)
            acc += _dot(a, w, None, FP8_DOT) * a_s * w_s
            if SILU_MUL:
                up_s = tl.load(up_scales + group * stride_wsk, mask=n_ok[None, :], other=0.0)
                acc_up += _dot(a, up, None, FP8_DOT) * a_s * up_s
        else:  # one scale a row on each side: applied once, after the loop
            acc = _dot(a, w, acc, FP8_DOT)
            if SILU_MUL:
                acc_up = _dot(a, up, acc_up, FP8_DOT)
        if SILU_MUL:
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not GROUPED:
        a_s = tl.load(a_scales, mask=valid, other=0.0)[:, None]
        acc *= a_s * tl.load(w_scales, mask=n_ok[None, :], other=0.0)
        if SILU_MUL:
            acc_up *= a_s * tl.load(up_scales, mask=n_ok[None, :], other=0.0)
    if SILU_MUL and GELU:  # x * sigmoid(2z) is 0.5 x (1 + tanh z), z = sqrt(2 / pi) (x + 0.044715 x^3)
        inner = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-inner)) * acc_up
    elif SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def fp8_tile_config(num_pairs: int, n: int, k: int) -> dict[str, int]:
    """`tile_config`'s tiles (moe_triton.py), but a long prefill's 128 x 64 rather than 128 x 128: there the two float32
    accumulators and a step's two scaled dots spill (`kernel_resources.py --families moe_fp8`)."""
    config = tile_config(num_pairs, n, k)
    if config["BLOCK_N"] == 128:
        config["BLOCK_N"] = 64
    return config


def quantize_activations(a: torch.Tensor, block_k: int, activations: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 a, float32 scales) of a matmul's input: a scale a row and block_k columns ("group"), or a row
    ("token")."""
    from kiln.backends.kernels.fp8_quant import quantize_groups, quantize_rows  # noqa: PLC0415

    if activations == "group":
        return quantize_groups(a, block_k)
    if activations == "token":
        return quantize_rows(a)
    raise ValueError(f"FP8 experts round their inputs per token or per group, not {activations!r}")


def grouped_fp8_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    config: dict[str, int],
    a_rows_are_tokens: bool,
    block_n: int,
    block_k: int,
    silu_mul: bool = False,
    weights: torch.Tensor | None = None,
    gelu: bool = False,
) -> None:
    """out[pair] = dequant(a[row]) @ dequant(w[e])^T for every pair (row: the pair's token, or the pair itself);
    with silu_mul, w holds gate's rows then up's (and `gelu` makes the activation GELU-tanh). `block_n` 0: a weight
    scale a row."""
    num_pairs, n = out.shape
    k = a.shape[1]
    config = dict(config)
    per_row_a, per_row_w = a_scale.shape[1] == 1, block_n == 0
    grouped = not (per_row_a and per_row_w)  # some scale covers block_k columns: a step must stay inside one
    if grouped:
        config["BLOCK_K"] = min(config["BLOCK_K"], block_k)
        assert block_k % config["BLOCK_K"] == 0, f"block_k {block_k}: a power of two"
    assert per_row_w or not silu_mul or n % block_n == 0, f"gate's {n} rows are not whole {block_n}-row blocks"
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    _grouped_fp8_matmul[grid](
        a,
        a_scale,
        w,
        w_scale,
        out,
        weights if weights is not None else out,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        n if silu_mul else 0,
        a.stride(0),
        a_scale.stride(0),
        0 if per_row_a else a_scale.stride(1),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        0 if per_row_w else w_scale.stride(2),
        out.stride(0),
        SCALE_N=block_n or 1,
        GROUP_K=block_k if grouped else config["BLOCK_K"],
        GROUPED=grouped,
        TOP_K=top_k,
        A_ROWS_ARE_TOKENS=a_rows_are_tokens,
        SILU_MUL=silu_mul,
        GELU=gelu,
        MUL_WEIGHT=weights is not None,
        FP8_DOT=a.is_cuda and config["BLOCK_K"] >= 32,  # (the FP8 tensor cores take K 32 at a time)
        **config,
    )


def experts_forward_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    block_n: int,
    block_k: int,
    activations: str,
    config: dict[str, int] | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """The FP8 experts for a given routing (weights, experts [T, k]): align, then the two grouped matmuls."""
    config = config or fp8_tile_config(experts.numel(), w13.shape[1], w13.shape[2])
    sorted_pairs, block_expert = align(experts, w13.shape[0], config["BLOCK_M"])
    scales = (w13_scale, w2, w2_scale, weights, sorted_pairs, block_expert, experts.shape[1], config)
    return _grouped(x, w13, *scales, block_n, block_k, activations, gelu)


def fused_moe_fp8(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    renormalise: bool,
    weights_dtype: torch.dtype,
    block_n: int,
    block_k: int,
    activations: str,
    config: dict[str, int] | None = None,
    expert_scales: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """`kiln::fused_moe_fp8` on the GPU (and under Triton's interpreter): routing and alignment (one launch for a
    decode), the weights times the chosen experts' `expert_scales` where given, then the roundings and the two
    grouped matmuls (GELU-tanh with `gelu`), and the sum over k."""
    config = config or fp8_tile_config(x.shape[0] * top_k, w13.shape[1], w13.shape[2])
    weights, experts, sorted_pairs, block_expert = route_and_align(
        router_logits, top_k, renormalise, weights_dtype, config["BLOCK_M"]
    )
    if expert_scales is not None:
        weights = weights * expert_scales[experts]
    scales = (w13_scale, w2, w2_scale, weights, sorted_pairs, block_expert, top_k, config)
    return _grouped(x, w13, *scales, block_n, block_k, activations, gelu)


def _grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    config: dict[str, int],
    block_n: int,
    block_k: int,
    activations: str,
    gelu: bool = False,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    layout = (sorted_pairs, block_expert, top_k, config)
    x_q, x_scale = quantize_activations(x, block_k, activations)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grouped_fp8_matmul(x_q, x_scale, w13, w13_scale, act, *layout, True, block_n, block_k, silu_mul=True, gelu=gelu)
    act_q, act_scale = quantize_activations(act, block_k, activations)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().contiguous()
    grouped_fp8_matmul(act_q, act_scale, w2, w2_scale, y, *layout, False, block_n, block_k, weights=flat_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)  # (accumulated in float32 by torch)
