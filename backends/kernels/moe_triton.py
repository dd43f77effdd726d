"""The experts of a mixture-of-experts layer as two grouped Triton matmuls (the GPU form of `kiln::fused_moe`).

    route:   each token's top-k experts and weights from the router's logits, and the pairs laid out by expert
             in blocks of BLOCK_M rows, each block one expert's (moe_routing.py: one launch for a decode)
    gemm 1:  act[pair] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T)      one launch, the SiLU-and-mul fused
                                                                          (GELU-tanh-and-mul for Gemma 4)
    gemm 2:  y[pair]   = weight[pair] * act[pair] @ down_e^T                  one launch, the routing weight fused
    sum:     out[t]    = sum over its k pairs of y (one torch kernel)

A block of rows belongs to one expert and reads only that expert's weights, so a step reads the weights of the
experts some token chose and no others: at batch 1, k experts' (the point of a mixture at low batch). The grids
are sized for the worst case of a shape (every chosen expert's run padded), and the blocks past the real end
return at once; so the launch depends on T alone, and every graph size records its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.moe_routing import align, route_and_align


def tile_config(num_pairs: int, n: int, k: int) -> dict[str, int]:
    """The tiles from the rows a step routes: a decode's few pairs BLOCK_M 16 (the least `tl.dot` takes) and
    narrow N blocks, so that k experts' weights spread over every SM; a long prefill's 128 x 128 (the best of
    `bench_moe.py --configs` on the qwen3-30b-a3b layer at each size)."""
    if num_pairs <= 64:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128 if k >= 128 else 64, num_warps=4, num_stages=4)
    if num_pairs <= 1024:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if k >= 128 else 64, num_warps=4, num_stages=4)
    if num_pairs <= 8192:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64 if k >= 64 else 32, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64 if k >= 64 else 32, num_warps=8, num_stages=3)


@triton.jit
def _grouped_matmul(
    a_ptr,  # [rows, K]: x (rows are tokens: pair // TOP_K) or act (rows are pairs)
    w_ptr,  # [E, N_total, K]
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    up_offset,  # SILU_MUL: the up projection's first row in w (gate's rows are 0..N)
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    A_ROWS_ARE_TOKENS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    GELU: tl.constexpr,  # SILU_MUL's activation GELU's tanh form, not SiLU
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
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        up_ptrs = w_ptrs + up_offset * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            up = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SILU_MUL and GELU:  # x * sigmoid(2z) is 0.5 x (1 + tanh z), z = sqrt(2 / pi) (x + 0.044715 x^3)
        inner = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-inner)) * acc_up
    elif SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    config: dict[str, int],
    a_rows_are_tokens: bool,
    silu_mul: bool = False,
    weights: torch.Tensor | None = None,
    gelu: bool = False,
) -> None:
    """out[pair] = a[row] @ w[e]^T for every pair (row: the pair's token, or the pair itself; see
    `_grouped_matmul`); with silu_mul, w holds gate's rows then up's (and `gelu` makes the activation GELU-tanh)."""
    num_pairs, n = out.shape
    k = a.shape[1]
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    _grouped_matmul[grid](
        a,
        w,
        out,
        weights if weights is not None else out,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        n if silu_mul else 0,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        A_ROWS_ARE_TOKENS=a_rows_are_tokens,
        SILU_MUL=silu_mul,
        GELU=gelu,
        MUL_WEIGHT=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **config,
    )


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The experts for a given routing (weights, experts [T, k]): align, then the two grouped matmuls."""
    num_pairs = experts.numel()
    config = config or tile_config(num_pairs, w13.shape[1], w13.shape[2])
    sorted_pairs, block_expert = align(experts, w13.shape[0], config["BLOCK_M"])
    return _grouped(x, w13, w2, weights, sorted_pairs, block_expert, experts.shape[1], config)


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalise: bool,
    weights_dtype: torch.dtype,
    config: dict[str, int] | None = None,
    expert_scales: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """`kiln::fused_moe` on the GPU (and under Triton's interpreter): routing and alignment in one launch for a
    decode (moe_routing.py), the weights times the chosen experts' `expert_scales` where given, then the two grouped
    matmuls (GELU-tanh with `gelu`) and the sum over k."""
    num_pairs = x.shape[0] * top_k
    config = config or tile_config(num_pairs, w13.shape[1], w13.shape[2])
    weights, experts, sorted_pairs, block_expert = route_and_align(
        router_logits, top_k, renormalise, weights_dtype, config["BLOCK_M"]
    )
    if expert_scales is not None:
        weights = weights * expert_scales[experts]
    return _grouped(x, w13, w2, weights, sorted_pairs, block_expert, top_k, config, gelu)


def _grouped(
    x, w13, w2, weights, sorted_pairs, block_expert, top_k: int, config: dict[str, int], gelu: bool = False
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grouped_matmul(x, w13, act, sorted_pairs, block_expert, top_k, config, True, silu_mul=True, gelu=gelu)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().contiguous()
    grouped_matmul(act, w2, y, sorted_pairs, block_expert, top_k, config, False, weights=flat_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)  # (accumulated in float32 by torch)
