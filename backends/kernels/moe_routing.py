"""A mixture-of-experts layer's routing on the GPU: each token's top-k experts and weights from the router's
logits, and the (token, expert) pairs laid out by expert for the grouped matmuls (moe_triton.py).

    route:  softmax over the E logits in float32, the k largest (lowest index first on a tie), optionally
            divided by their sum (`renormalise`), stored in the weights' dtype
    align:  the T * k pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M (`sorted_pairs`;
            padding = T * k), and the expert of every BLOCK_M rows (`block_expert`, -1 past the end)

A decode has a few pairs (up to 16 tokens x 8), and each of these steps is a handful of instructions on them: one
program does both (`route_and_align`), one launch a layer where torch's softmax, top-k, division and sort take a
dozen. More pairs take three launches (`_parallel`): programs of CHUNK_PAIRS pairs route their tokens and count
their pairs by expert; one program turns the counts into each chunk's first place for each expert (the experts'
padded runs in order, a chunk's pairs after the earlier chunks'); the chunks' programs place their pairs. The
layout is the same as torch's stable sort (`route_reference`, `align_reference`: the tests' references). None of
them syncs with the host, so the whole op records into a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Up to this many pairs the single program, past it the three launches of the parallel form: the single program's
# loops grow with the pairs while the parallel form's launches cost about the same at any size, and they cross near
# here (scripts/dev/time_moe_routing.py, 128 experts top-8).
KERNEL_MAX_PAIRS = 128
CHUNK_PAIRS = 256  # pairs a program of the parallel form takes (at most: whole tokens)


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `sorted_pairs`: at most min(E, T * k) experts are chosen, each padding its run by under block_m."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def route_reference(
    logits: torch.Tensor, top_k: int, renormalise: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `weights_dtype`, experts [T, k] int32) from the router's logits [T, E], in torch ops."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), experts.to(torch.int32)


def align_reference(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for `experts` [T, k] in torch ops (a stable sort by expert)."""
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
def _route(
    logits_ptr,
    stride_logits,
    weights_ptr,
    experts_ptr,
    num_tokens,
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Each token's top-k of the softmax of its logits, CHUNK tokens at a time."""
    bins = tl.arange(0, E_PAD)
    rows = tl.arange(0, CHUNK)
    slots = tl.arange(0, K_PAD)
    for start in range(0, num_tokens, CHUNK):
        tokens = start + rows
        ok = tokens < num_tokens
        mask = ok[:, None] & (bins[None, :] < num_experts)
        ptrs = logits_ptr + tokens[:, None].to(tl.int64) * stride_logits + bins[None, :]
        logits = tl.load(ptrs, mask=mask, other=-float("inf")).to(tl.float32)
        logits = tl.where(ok[:, None], logits, 0.0)  # (rows past the end: no NaN from an all -inf row)
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        top_w = tl.zeros((CHUNK, K_PAD), dtype=tl.float32)
        top_e = tl.zeros((CHUNK, K_PAD), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(p, axis=1, tie_break_left=True)
            top_w = tl.where(slots[None, :] == j, tl.max(p, axis=1)[:, None], top_w)
            top_e = tl.where(slots[None, :] == j, best[:, None], top_e)
            p = tl.where(bins[None, :] == best[:, None], -1.0, p)
        if RENORMALISE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        out = tokens[:, None] * TOP_K + slots[None, :]
        stored = ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=stored)
        tl.store(experts_ptr + out, top_e, mask=stored)


@triton.jit
def _align(
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
    """Count each expert's pairs, lay out their runs (`_expert_runs`), then place every pair after the earlier pairs
    of its expert (stable, as a sort by expert is)."""
    bins = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        e = tl.load(experts_ptr + start + lanes, mask=valid, other=-1)
        counts += tl.sum(((e[:, None] == bins[None, :]) & valid[:, None]).to(tl.int32), axis=0)
    taken = _expert_runs(
        counts, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, rows, BLOCK_M, E_PAD, CHUNK
    )
    tl.debug_barrier()  # the padding is written before any pair's place
    _place_range(experts_ptr, 0, num_pairs, taken, sorted_pairs_ptr, E_PAD, CHUNK)


@triton.jit
def _expert_runs(
    counts,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    rows,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """From each expert's pair count: every row of `sorted_pairs` padding (until a pair takes it), each expert's run
    padded to BLOCK_M rows and the runs in expert order, the expert of every block; returns each run's first row."""
    bins = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    for start in range(0, rows, CHUNK):
        tl.store(sorted_pairs_ptr + start + lanes, num_pairs, mask=start + lanes < rows)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_end = tl.where(bins < num_experts, padded_end, 2147483647)  # (padding bins never own a block)
    for start in range(0, rows, CHUNK * BLOCK_M):
        blocks = start // BLOCK_M + lanes
        owner = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=blocks * BLOCK_M < rows)
    return padded_end - padded


@triton.jit
def _place_range(experts_ptr, start, end, taken, sorted_pairs_ptr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs [start, end) placed CHUNK at a time (`_place`), `taken` where each expert's next pair goes."""
    lanes = tl.arange(0, CHUNK)
    for chunk_start in range(start, end, CHUNK):
        valid = chunk_start + lanes < end
        e = tl.load(experts_ptr + chunk_start + lanes, mask=valid, other=-1)
        taken += _place(e, valid, lanes, chunk_start + lanes, taken, sorted_pairs_ptr, E_PAD)


@triton.jit
def _place(e, valid, lanes, pairs, first, sorted_pairs_ptr, E_PAD: tl.constexpr):
    """Each valid pair (of expert e) into `sorted_pairs` at its expert's `first` row plus the lanes before it with
    the same expert; returns how many pairs each expert got."""
    one_hot = (e[:, None] == tl.arange(0, E_PAD)[None, :]) & valid[:, None]
    base = tl.sum(tl.where(one_hot, first[None, :], 0), axis=1)
    earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None]) & valid[None, :]
    tl.store(sorted_pairs_ptr + base + tl.sum(earlier.to(tl.int32), axis=1), pairs, mask=valid)
    return tl.sum(one_hot.to(tl.int32), axis=0)


@triton.jit
def _route_and_align_kernel(
    logits_ptr,
    stride_logits,
    weights_ptr,
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_tokens,
    num_experts,
    rows,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    ROUTE: tl.constexpr,  # False: `experts` is given (align only)
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    CHUNK_T: tl.constexpr,
    CHUNK: tl.constexpr,
):
    if ROUTE:
        _route(
            logits_ptr,
            stride_logits,
            weights_ptr,
            experts_ptr,
            num_tokens,
            num_experts,
            TOP_K,
            RENORMALISE,
            E_PAD,
            K_PAD,
            CHUNK_T,
        )
        tl.debug_barrier()  # every token's experts are written before the alignment reads them
    _align(
        experts_ptr, sorted_pairs_ptr, block_expert_ptr, num_tokens * TOP_K, num_experts, rows, BLOCK_M, E_PAD, CHUNK
    )


def _launch(logits, weights, experts, num_experts: int, top_k: int, renormalise: bool, route: bool, block_m: int):
    num_tokens = experts.shape[0]
    rows = capacity(num_tokens * top_k, num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=experts.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=experts.device)
    e_pad = triton.next_power_of_2(num_experts)
    _route_and_align_kernel[(1,)](
        logits,
        logits.stride(0),
        weights,
        experts,
        sorted_pairs,
        block_expert,
        num_tokens,
        num_experts,
        rows,
        TOP_K=top_k,
        RENORMALISE=renormalise,
        ROUTE=route,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k),
        CHUNK_T=max(1, min(16, 4096 // e_pad)),
        CHUNK=64 if e_pad <= 128 else 32,
        num_warps=8,
    )
    return sorted_pairs, block_expert


@triton.jit
def _count_kernel(
    logits_ptr,
    stride_logits,
    weights_ptr,
    experts_ptr,
    counts_ptr,  # [chunks, E_PAD]
    num_tokens,
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    ROUTE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    CHUNK_T: tl.constexpr,  # tokens a program
    ROUTE_T: tl.constexpr,  # tokens `_route` takes at a time
    PAIRS_PAD: tl.constexpr,  # CHUNK_T * TOP_K, to a power of two
):
    chunk = tl.program_id(0)
    first = chunk * CHUNK_T
    if ROUTE:
        _route(
            logits_ptr + first.to(tl.int64) * stride_logits,
            stride_logits,
            weights_ptr + first * TOP_K,
            experts_ptr + first * TOP_K,
            tl.minimum(num_tokens - first, CHUNK_T),
            num_experts,
            TOP_K,
            RENORMALISE,
            E_PAD,
            K_PAD,
            ROUTE_T,
        )
        tl.debug_barrier()  # this program's experts are written before it counts them
    lanes = tl.arange(0, PAIRS_PAD)
    pairs = first * TOP_K + lanes
    valid = (lanes < CHUNK_T * TOP_K) & (pairs < num_tokens * TOP_K)
    e = tl.load(experts_ptr + pairs, mask=valid, other=-1)
    bins = tl.arange(0, E_PAD)
    counts = tl.sum(((e[:, None] == bins[None, :]) & valid[:, None]).to(tl.int32), axis=0)
    tl.store(counts_ptr + chunk * E_PAD + bins, counts)


@triton.jit
def _offsets_kernel(
    counts_ptr,  # [chunks, E_PAD] in; each chunk's first place for each expert out (in place)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_chunks,
    num_pairs,
    num_experts,
    rows,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    bins = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(num_chunks):
        total += tl.load(counts_ptr + c * E_PAD + bins)
    place = _expert_runs(total, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, rows, BLOCK_M, E_PAD, CHUNK)
    for c in range(num_chunks):
        count = tl.load(counts_ptr + c * E_PAD + bins)
        tl.store(counts_ptr + c * E_PAD + bins, place)
        place += count


@triton.jit
def _place_kernel(
    experts_ptr,
    offsets_ptr,  # [chunks, E_PAD]
    sorted_pairs_ptr,
    num_pairs,
    PAIRS: tl.constexpr,  # pairs a chunk
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """A chunk's pairs placed CHUNK at a time, as `_align` places them (one step over all of a chunk's pairs would
    compare each with each)."""
    chunk = tl.program_id(0)
    taken = tl.load(offsets_ptr + chunk * E_PAD + tl.arange(0, E_PAD))
    end = tl.minimum((chunk + 1) * PAIRS, num_pairs)
    _place_range(experts_ptr, chunk * PAIRS, end, taken, sorted_pairs_ptr, E_PAD, CHUNK)


def _parallel(logits, weights, experts, num_experts: int, top_k: int, renormalise: bool, route: bool, block_m: int):
    """(sorted_pairs, block_expert) in three launches (see the module's docstring); with `route`, `weights` and
    `experts` are filled from `logits` on the way."""
    num_tokens = experts.shape[0]
    num_pairs = num_tokens * top_k
    rows = capacity(num_pairs, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    chunk_t = max(1, CHUNK_PAIRS // top_k)
    num_chunks = triton.cdiv(num_tokens, chunk_t)
    pairs_pad = triton.next_power_of_2(chunk_t * top_k)
    chunk = 64 if e_pad <= 128 else 32  # (as the single program's)
    device = experts.device
    offsets = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](
        logits,
        logits.stride(0),
        weights,
        experts,
        offsets,
        num_tokens,
        num_experts,
        TOP_K=top_k,
        RENORMALISE=renormalise,
        ROUTE=route,
        E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k),
        CHUNK_T=chunk_t,
        ROUTE_T=max(1, min(16, chunk_t, 4096 // e_pad)),
        PAIRS_PAD=pairs_pad,
        num_warps=8,
    )
    _offsets_kernel[(1,)](
        offsets,
        sorted_pairs,
        block_expert,
        num_chunks,
        num_pairs,
        num_experts,
        rows,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        num_warps=8,
    )
    _place_kernel[(num_chunks,)](
        experts, offsets, sorted_pairs, num_pairs, PAIRS=chunk_t * top_k, E_PAD=e_pad, CHUNK=chunk, num_warps=8
    )
    return sorted_pairs, block_expert


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for given `experts` [T, k]: the single program for few pairs, else the
    parallel form."""
    experts = experts.contiguous()
    launch = _launch if experts.numel() <= KERNEL_MAX_PAIRS else _parallel
    return launch(experts, experts, experts, num_experts, experts.shape[1], False, False, block_m)


def route_and_align(
    logits: torch.Tensor, top_k: int, renormalise: bool, weights_dtype: torch.dtype, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, experts, sorted_pairs, block_expert) from the router's logits [T, E]: one launch for few pairs,
    three for more."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    launch = _launch if num_tokens * top_k <= KERNEL_MAX_PAIRS else _parallel
    sorted_pairs, block_expert = launch(logits, weights, experts, num_experts, top_k, renormalise, True, block_m)
    return weights, experts, sorted_pairs, block_expert
