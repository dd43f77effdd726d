"""The experts of a mixture-of-experts layer as two grouped Triton matmuls (the GPU form of `kiln::fused_moe`).

    align:   the T * k (token, expert) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
             (`sorted_pairs`, padding = T * k), and the expert of every BLOCK_M rows (`block_expert`, -1 past the
             end): one single-program launch, no host sync, so the whole op records into a CUDA graph (a dozen
             torch ops would do it too, at a dozen launches a layer)
    gemm 1:  act[pair] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T)      one launch, the SiLU-and-mul fused
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

# Up to this many (token, expert) pairs `align` is one single-program kernel; past it, the program's loop would
# outlast the dozen parallel torch kernels of `align_reference`, which lay the pairs out the same way.
ALIGN_KERNEL_MAX_PAIRS = 4096


def tile_config(num_pairs: int, n: int, k: int) -> dict[str, int]:
    """BLOCK_M from the rows a step routes (a decode's few pairs: 16, the least `tl.dot` takes), the rest fixed."""
    if num_pairs <= 64:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if k >= 128 else 64, num_warps=4, num_stages=4)
    block_m = 32 if num_pairs <= 1024 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64 if k >= 64 else 32, num_warps=4, num_stages=3)


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `sorted_pairs`: at most min(E, T * k) experts are chosen, each padding its run by under block_m."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_reference(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `experts` [T, k] in torch ops (no host sync either): `align`'s form for
    many pairs, and the tests' reference for its kernel."""
    flat = experts.flatten().long()
    num_pairs = flat.numel()
    rows = capacity(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(padded_end - padded)[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _align_kernel(
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    rows,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`align` in one program: count each expert's pairs, pad and prefix-sum the counts, name each block's expert,
    then place every pair after the earlier pairs of its expert (stable, as a sort by expert is)."""
    bins = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    for start in range(0, rows, CHUNK):  # every row padding until a pair takes it
        tl.store(sorted_pairs_ptr + start + lanes, num_pairs, mask=start + lanes < rows)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        e = tl.load(experts_ptr + start + lanes, mask=valid, other=-1)
        counts += tl.sum(((e[:, None] == bins[None, :]) & valid[:, None]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_end = tl.where(bins < num_experts, padded_end, 2147483647)  # (padding bins never own a block)
    for start in range(0, rows, CHUNK * BLOCK_M):
        blocks = start // BLOCK_M + lanes
        owner = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks * BLOCK_M < rows)
    tl.debug_barrier()  # the padding is written before any pair's place
    taken = padded_end - padded  # where each expert's next pair goes
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        e = tl.load(experts_ptr + start + lanes, mask=valid, other=-1)
        one_hot = (e[:, None] == bins[None, :]) & valid[:, None]
        base = tl.sum(tl.where(one_hot, taken[None, :], 0), axis=1)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None]) & valid[None, :]
        place = base + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + place, start + lanes, mask=valid)
        taken += tl.sum(one_hot.to(tl.int32), axis=0)


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `experts` [T, k] (see the module's docstring): one launch for a decode's
    few pairs, `align_reference`'s torch ops for a prefill's many."""
    num_pairs = experts.numel()
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS:
        return align_reference(experts, num_experts, block_m)
    rows = capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=experts.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=experts.device)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = 64 if e_pad <= 128 else 32
    _align_kernel[(1,)](
        experts.contiguous(),
        sorted_pairs,
        block_expert,
        num_pairs,
        num_experts,
        rows,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        num_warps=8,
    )
    return sorted_pairs, block_expert


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
    if SILU_MUL:
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
) -> None:
    """out[pair] = a[row] @ w[e]^T for every pair (row: the pair's token, or the pair itself; see
    `_grouped_matmul`); with silu_mul, w holds gate's rows then up's."""
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
        MUL_WEIGHT=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **config,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """`kiln::fused_moe` on the GPU (and under Triton's interpreter): see the module's docstring."""
    num_tokens, top_k = experts.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    config = config or tile_config(num_pairs, two_i, hidden)
    sorted_pairs, block_expert = align(experts, num_experts, config["BLOCK_M"])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grouped_matmul(x, w13, act, sorted_pairs, block_expert, top_k, config, True, silu_mul=True)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().contiguous()
    grouped_matmul(act, w2, y, sorted_pairs, block_expert, top_k, config, False, weights=flat_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)  # (accumulated in float32 by torch)
