"""gpt-oss's experts as two grouped Triton matmuls (the GPU form of `kiln::gpt_oss_moe`), their weights 16-bit or
MXFP4, which stay 4-bit in memory and are dequantized in registers.

    route:   each token's top k experts and weights from the router's logits, and the T * k (token, expert) pairs
             laid out by expert in blocks of BLOCK_M rows: one launch for a decode (moe_routing.route_and_align)
    gemm 1:  act[pair]  = clamped_swiglu(x[token] @ gate_e^T + bg_e, x[token] @ up_e^T + bu_e)   biases and act fused
    gemm 2:  y[pair]    = weight[pair] * (act[pair] @ down_e^T + bd_e)                            bias and weight fused
    sum:     out[t]     = sum over its k pairs of y (one torch kernel)

A block of rows is one expert's and reads only that expert's weights, so a step reads the chosen experts' weights and
no others: at batch 1, k experts' 4-bit bytes. The grids are sized for the worst case of a shape and the blocks past
the real end return at once: the launch depends on T alone, no host sync, so the op records into CUDA graphs.

An MXFP4 tile: BLOCK_K / 2 bytes of each of BLOCK_N weight rows, a byte holding columns 2j (low nibble) and 2j + 1
(high nibble). Rather than interleave the two nibbles' values back into one [BLOCK_K, BLOCK_N] tile (a shuffle across
registers), the activations' even and odd columns are loaded as two [BLOCK_M, BLOCK_K / 2] tiles, and each nibble's
values meet their own columns in a dot of half the depth:

    acc += a[:, 0::2] @ E2M1(low) * 2^(s - 127)  +  a[:, 1::2] @ E2M1(high) * 2^(s - 127)

A value times its block's power of two is exact in the activations' dtype (mxfp4.py), so nothing is rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.gpt_oss_moe import Experts
from kiln.backends.kernels.moe_routing import align, route_and_align


def tile_config(num_pairs: int, k: int, mxfp4: bool) -> dict[str, int]:
    """The tiles from the rows a step routes: a decode's few pairs BLOCK_M 16 (the least `tl.dot` takes) and narrow N
    blocks, so k experts' weights spread over every SM; a long prefill's 64 x 64 or 128 x 128 (MXFP4: 128 x 64). MXFP4
    reads BLOCK_K a multiple of 64 (whole 32-value scale blocks, halves of 32 columns for `tl.dot`)."""
    # (MXFP4's 16 x 64 tiles at 128 deep spill on sm_90: two weight tiles of nibbles decoded at once)
    block_k = 128 if k >= 128 and (num_pairs <= 64 or num_pairs <= 1024 and not mxfp4) else 64
    if num_pairs <= 64:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, num_warps=4, num_stages=4)
    if num_pairs <= 1024:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4)
    if num_pairs <= 8192:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    # NOTE: MXFP4's gate/up at 128 x 128 (two accumulators and the nibbles' decode) spills 120 bytes a thread on sm_90
    # (scripts/dev/kernel_resources.py); 128 x 64 does not
    return dict(BLOCK_M=128, BLOCK_N=64 if mxfp4 else 128, BLOCK_K=64, num_warps=8, num_stages=3)


@triton.jit
def _mxfp4_values(code, factor):
    """e2m1 codes (0-15, int32) times their blocks' factors, from bits rather than arithmetic (decoding the nibbles,
    not reading their bytes, is what a decode step's matmul would spend its time on): a code's sign, exponent and
    mantissa bits shifted into a float32's top bits read as the code's value times 2^-126 (codes 0.5 and 0 as
    subnormals), so two exact products give value * factor."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * factor  # (2^126)


@triton.jit
def _mxfp4_step(
    acc,
    a_even,
    a_odd,
    w_rows,
    s_rows,
    k0,
    offs_j,
    j_ok,
    n_ok,
    PRECISION: tl.constexpr,
):
    """acc plus the activations' BLOCK_K columns from k0 (their even and odd ones) times the MXFP4 weights of the
    rows at `w_rows` (byte pointers [BLOCK_N]) and their scales at `s_rows`; `offs_j`: the tile's byte offsets."""
    mask = j_ok[:, None] & n_ok[None, :]
    packed = tl.load(w_rows[None, :] + (k0 // 2 + offs_j)[:, None], mask=mask, other=0).to(tl.int32)
    scales = tl.load(s_rows[None, :] + (k0 // 32 + offs_j // 16)[:, None], mask=mask, other=127)
    factor = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127), a float32's exponent bits
    low = _mxfp4_values(packed & 15, factor).to(a_even.dtype)
    high = _mxfp4_values(packed >> 4, factor).to(a_even.dtype)
    acc = tl.dot(a_even, low, acc, input_precision=PRECISION)
    return tl.dot(a_odd, high, acc, input_precision=PRECISION)


@triton.jit
def _gpt_oss_matmul(
    a_ptr,  # [rows, K]: x (rows are tokens: pair // TOP_K) or act (rows are pairs)
    w_ptr,  # [E, N_total, K] 16-bit, or MXFP4 [E, N_total, K / 2] uint8
    scale_ptr,  # MXFP4: [E, N_total, K / 32] uint8
    bias_ptr,  # [E, N_total] (HAS_BIAS)
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    up_offset,  # SWIGLU: the up projection's first row in w (the gate's are 0..N)
    alpha,
    limit,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    A_ROWS_ARE_TOKENS: tl.constexpr,
    SWIGLU: tl.constexpr,  # gate and up rows, then the clamped SwiGLU of the two
    MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,  # float32 inputs: "ieee" (not TF32's 10-bit mantissa); ignored for 16-bit ones
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
    rows = pairs // TOP_K if A_ROWS_ARE_TOKENS else pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:
        s_rows = scale_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
        offs_j = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, K, BLOCK_K):
            j_ok = offs_j < (K - k0) // 2
            a_mask = valid[:, None] & j_ok[None, :]
            a_even = tl.load(a_rows + (k0 + 2 * offs_j)[None, :], mask=a_mask, other=0.0)
            a_odd = tl.load(a_rows + (k0 + 2 * offs_j + 1)[None, :], mask=a_mask, other=0.0)
            acc = _mxfp4_step(acc, a_even, a_odd, w_rows, s_rows, k0, offs_j, j_ok, n_ok, PRECISION)
            if SWIGLU:
                up_w = w_rows + up_offset * stride_wn
                up_s = s_rows + up_offset * stride_sn
                acc_up = _mxfp4_step(acc_up, a_even, a_odd, up_w, up_s, k0, offs_j, j_ok, n_ok, PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_rows[None, :] + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
            if SWIGLU:
                up = tl.load(w_rows[None, :] + up_offset * stride_wn + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(a, up.to(a.dtype), acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_row + up_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # (up + 1) * g * sigmoid(alpha g), g = min(gate, limit), up within +-limit
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    config: dict[str, int],
    a_rows_are_tokens: bool,
    swiglu: tuple[float, float] | None = None,
    weights: torch.Tensor | None = None,
) -> None:
    """out[pair] = a[row] @ w[e]^T (+ bias[e]) for every pair (row: the pair's token, or the pair itself); with
    `swiglu` (alpha, limit), w holds the gate's rows then the up projection's and out their clamped SwiGLU; with
    `weights`, each row times its pair's routing weight. MXFP4 weights come with their `scale`."""
    num_pairs, n = out.shape
    k = a.shape[1]
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    alpha, limit = swiglu or (0.0, 0.0)
    _gpt_oss_matmul[grid](
        a,
        w,
        scale if scale is not None else w,
        bias if bias is not None else out,
        out,
        weights if weights is not None else out,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        n if swiglu else 0,
        alpha,
        limit,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        scale.stride(0) if scale is not None else 0,
        scale.stride(1) if scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        A_ROWS_ARE_TOKENS=a_rows_are_tokens,
        SWIGLU=swiglu is not None,
        MXFP4=scale is not None,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **config,
    )


def gpt_oss_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    layer: Experts,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """gpt-oss's experts for a given routing (weights, experts [T, k]) on the GPU (and under Triton's interpreter):
    align the pairs, the two grouped matmuls, the sum over k. `config`: the tiles, by default `tile_config`'s (the
    benchmarks sweep it)."""
    config = config or tile_config(experts.numel(), x.shape[1], layer.w13_scale is not None)
    sorted_pairs, block_expert = align(experts.to(torch.int32), layer.w13.shape[0], config["BLOCK_M"])
    return _experts(x, weights, sorted_pairs, block_expert, experts.shape[1], config, layer)


def routed_gpt_oss_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, layer: Experts) -> torch.Tensor:
    """`kiln::gpt_oss_moe` on the GPU: the routing (the top k of the softmax, renormalised) and the pairs' alignment
    in one launch for a decode (moe_routing.py), then the experts."""
    config = tile_config(x.shape[0] * top_k, x.shape[1], layer.w13_scale is not None)
    weights, _, sorted_pairs, block_expert = route_and_align(router_logits, top_k, True, x.dtype, config["BLOCK_M"])
    return _experts(x, weights, sorted_pairs, block_expert, top_k, config, layer)


def _experts(
    x, weights, sorted_pairs, block_expert, top_k: int, config: dict[str, int], layer: Experts
) -> torch.Tensor:
    """The two grouped matmuls over the aligned pairs and the sum over k."""
    w13, w13_bias, w2, w2_bias, alpha, limit, w13_scale, w2_scale = layer
    num_tokens, hidden = x.shape
    num_pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    x = x.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grouped_matmul(
        x, w13, w13_scale, w13_bias, act, sorted_pairs, block_expert, top_k, config, True, swiglu=(alpha, limit)
    )
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().contiguous()
    grouped_matmul(
        act, w2, w2_scale, w2_bias, y, sorted_pairs, block_expert, top_k, config, False, weights=flat_weights
    )
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
