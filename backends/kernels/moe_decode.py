"""A mixture-of-experts layer for a decode of a few tokens (the GPU form of `kiln::fused_moe` up to
DECODE_MAX_TOKENS): two launches, each program a few weight rows of one expert, dotted in registers.

    gate_up:  program (pair, rows): its token's routing from the router's logits (softmax, top-k, renormalised, as
              moe_routing.py does), then act[pair] = silu(x @ gate_e^T) * (x @ up_e^T) over its rows of expert e;
              the first program of a pair also stores the pair's expert and weight for the next launch
    down:     program (token, rows): out[t] = sum over its k pairs of weight * act[pair] @ down_e^T, the sum over k
              and the routing weights in the same float32 accumulator

A decode reads each chosen expert's weights once and does two flops a byte, so its speed is the bandwidth of the
loads, as in the dense one-row matmul (gemv.py), whose tile shape these programs take. The grouped matmuls
(moe_triton.py) pad every expert's single row to a `tl.dot` of 16 and need the pairs sorted first (a launch of its
own) and a sum over k after (another); here a layer is the two launches, and no program depends on a sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.gemv import default_config

# Up to this many tokens the per-pair programs; past it, the grouped matmuls, which read a shared expert once.
DECODE_MAX_TOKENS = 4


@triton.jit
def _route_one(
    logits_ptr, num_experts, TOP_K: tl.constexpr, RENORMALISE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr
):
    """(weights, experts, slots), each [K_PAD], of one token: the top-k of the softmax of its logits in float32, the
    lowest index first on a tie (as `route_reference` and moe_routing.py's `_route`)."""
    bins = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + bins, mask=bins < num_experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros(slots.shape, dtype=tl.float32)
    top_e = tl.zeros(slots.shape, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0, tie_break_left=True)
        top_w = tl.where(slots == j, tl.max(p, axis=0), top_w)
        top_e = tl.where(slots == j, best, top_e)
        p = tl.where(bins == best, -1.0, p)
    if RENORMALISE:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_e, slots


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K]
    logits_ptr,  # [T, E] (ROUTE)
    w_ptr,  # [E, 2N, K]: gate's rows, then up's
    act_ptr,  # [T * TOP_K, N]
    weights_ptr,  # [T * TOP_K]: stored (ROUTE) or given
    experts_ptr,  # [T * TOP_K]: stored (ROUTE) or given
    stride_x,
    stride_logits,
    num_experts,
    N,
    K,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    ROUTE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // TOP_K
    if ROUTE:
        top_w, top_e, slots = _route_one(
            logits_ptr + token.to(tl.int64) * stride_logits, num_experts, TOP_K, RENORMALISE, E_PAD, K_PAD
        )
        mine = slots == pair % TOP_K
        expert = tl.sum(tl.where(mine, top_e, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(experts_ptr + pair, expert)
            tl.store(weights_ptr + pair, tl.sum(tl.where(mine, top_w, 0.0), axis=0).to(weights_ptr.dtype.element_ty))
    else:
        expert = tl.load(experts_ptr + pair)
    idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(idx, N - 1)  # (rows past N re-read row N-1, so every load is a full-width vector)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_x + offs_k
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0).to(tl.float32)[None, :]
            gate += tl.sum(tl.load(gate_ptrs + k0).to(tl.float32) * x, axis=1)
            up += tl.sum(tl.load(up_ptrs + k0).to(tl.float32) * x, axis=1)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            gate += tl.sum(tl.load(gate_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * x, axis=1)
            up += tl.sum(tl.load(up_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * x, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up  # (as the grouped matmul: SiLU of the float32 sum)
    tl.store(act_ptr + pair.to(tl.int64) * N + idx, act.to(act_ptr.dtype.element_ty), mask=idx < N)


@triton.jit
def _down_kernel(
    act_ptr,  # [T * TOP_K, K]
    w_ptr,  # [E, N, K]
    weights_ptr,  # [T * TOP_K]
    experts_ptr,  # [T * TOP_K]
    out_ptr,  # [T, N]
    N,
    K,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    token = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(idx, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(experts_ptr + pair)
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        a_ptrs = act_ptr + pair.to(tl.int64) * K + offs_k
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs + k0).to(tl.float32)[None, :]
                part += tl.sum(tl.load(w_ptrs + k0).to(tl.float32) * a, axis=1)
            else:
                k_ok = (k0 + offs_k) < K
                a = tl.load(a_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                part += tl.sum(tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * a, axis=1)
        acc += tl.load(weights_ptr + pair).to(tl.float32) * part
    tl.store(out_ptr + token.to(tl.int64) * stride_out + idx, acc.to(out_ptr.dtype.element_ty), mask=idx < N)


Config = tuple[int, int, int, int, int, int]  # gate_up's (BLOCK_N, BLOCK_K, num_warps), then down's


def decode_config(hidden: int, inter: int) -> Config:
    """The dense one-row matmul's tiles (gemv.py `default_config`): gate_up's rows counted in pairs."""
    n, k, warps = default_config(2 * inter, hidden)
    return (max(1, n // 2), k, warps, *default_config(hidden, inter))


def decode_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    router_logits: torch.Tensor | None = None,
    renormalise: bool = True,
    weights: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
    weights_dtype: torch.dtype | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """The experts of a few tokens x [T, H]: routed here from `router_logits` [T, E], or for given `weights` and
    `experts` [T, k]. Two launches, no host sync."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    n1, k1, warps1, n2, k2, warps2 = config or decode_config(hidden, inter)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    route = router_logits is not None
    if route:
        weights = torch.empty(num_tokens * top_k, dtype=weights_dtype or x.dtype, device=x.device)
        experts = torch.empty(num_tokens * top_k, dtype=torch.int32, device=x.device)
    else:
        weights, experts = weights.flatten().contiguous(), experts.flatten().to(torch.int32).contiguous()
    logits = router_logits if route else x
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, n1))](
        x,
        logits,
        w13,
        act,
        weights,
        experts,
        x.stride(0),
        logits.stride(0),
        num_experts,
        inter,
        hidden,
        w13.stride(0),
        w13.stride(1),
        TOP_K=top_k,
        RENORMALISE=renormalise,
        ROUTE=route,
        E_PAD=triton.next_power_of_2(num_experts),
        K_PAD=triton.next_power_of_2(top_k),
        BLOCK_N=n1,
        BLOCK_K=k1,
        EVEN_K=hidden % k1 == 0,
        num_warps=warps1,
    )
    out = torch.empty_like(x)
    _down_kernel[(num_tokens, triton.cdiv(hidden, n2))](
        act,
        w2,
        weights,
        experts,
        out,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=n2,
        BLOCK_K=k2,
        EVEN_K=inter % k2 == 0,
        num_warps=warps2,
    )
    return out
