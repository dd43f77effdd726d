"""Gated DeltaNet's short causal convolution in Triton: depthwise over each channel, then SiLU.

Request i's history is its conv state (the last K - 1 inputs before this step, oldest first; zeros without context)
followed by its tokens, and

    out[t, d] = silu(sum_j weight[d, j] * history[t - (K - 1) + j, d])       (weight[:, K - 1]: the token itself)

as PyTorch's conv1d with K - 1 zeros of left padding. Afterwards `conv_states[state_slots[i]]` holds the history's
last K - 1 rows. For K = 4 and a request of two tokens a, b with state s0 s1 s2:

    history   s0 s1 s2 a  b        out[a] reads s0 s1 s2 a,  out[b] reads s1 s2 a b
    new state       s2 a  b
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_D = 128


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _causal_conv1d_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    conv_states_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    state_slots_ptr,
    token_request_ptr,  # [T] each token's request
    num_tokens,
    stride_x_t,
    stride_o_t,
    stride_w_d,
    stride_s_slot,
    stride_s_row,
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program: BLOCK_T tokens (of any requests) x BLOCK_D channels. A tap before its request's first token reads
    the request's conv state (row K - 1 + (source - start)), or zero without context."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < num_tokens
    d_mask = offs_d < D
    request = tl.load(token_request_ptr + offs_t, mask=t_mask, other=0)
    start = tl.load(query_start_loc_ptr + request, mask=t_mask, other=0)
    q_len = tl.load(query_start_loc_ptr + request + 1, mask=t_mask, other=0) - start
    has_state = tl.load(seq_lens_ptr + request, mask=t_mask, other=0) - q_len > 0
    slot = tl.load(state_slots_ptr + request, mask=t_mask, other=0).to(tl.int64)
    mask = t_mask[:, None] & d_mask[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        source = offs_t - (K - 1) + j
        in_request = source >= start
        x_ptrs = x_ptr + source[:, None].to(tl.int64) * stride_x_t + offs_d[None, :]
        tap = tl.load(x_ptrs, mask=mask & in_request[:, None], other=0.0).to(tl.float32)
        state_row = K - 1 + source - start
        state_ptrs = (
            conv_states_ptr + slot[:, None] * stride_s_slot + state_row[:, None] * stride_s_row + offs_d[None, :]
        )
        from_state = mask & (~in_request & has_state)[:, None]
        tap += tl.load(state_ptrs, mask=from_state, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + offs_d * stride_w_d + j, mask=d_mask, other=0.0).to(tl.float32)
        acc += tap * weight[None, :]
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_o_t + offs_d[None, :]
    tl.store(out_ptrs, _silu(acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_state_kernel(
    conv_states_ptr,
    x_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    state_slots_ptr,
    stride_x_t,
    stride_s_slot,
    stride_s_row,
    D: tl.constexpr,
    K: tl.constexpr,
    ROWS_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program: one request, BLOCK_D channels. The new state's row r is history row q_len + r: a token's, or (for
    fewer than K - 1 tokens) an old state row, read before any is written (one program owns these columns)."""
    request = tl.program_id(1)
    offs_r = tl.arange(0, ROWS_P)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - start
    has_state = tl.load(seq_lens_ptr + request) - q_len > 0
    slot = tl.load(state_slots_ptr + request).to(tl.int64)
    history_row = q_len + offs_r
    mask = (offs_r < K - 1)[:, None] & (offs_d < D)[None, :]
    from_tokens = history_row >= K - 1
    x_ptrs = x_ptr + (start + history_row - (K - 1))[:, None].to(tl.int64) * stride_x_t + offs_d[None, :]
    rows = tl.load(x_ptrs, mask=mask & from_tokens[:, None], other=0.0).to(tl.float32)
    state_base = conv_states_ptr + slot * stride_s_slot + offs_d[None, :]
    # (tl.where: Triton's interpreter refuses a tensor mask and-ed with a loaded scalar)
    from_old = tl.where(has_state, mask & ~from_tokens[:, None], False)
    rows += tl.load(state_base + history_row[:, None] * stride_s_row, mask=from_old, other=0.0).to(tl.float32)
    tl.store(state_base + offs_r[:, None] * stride_s_row, rows.to(conv_states_ptr.dtype.element_ty), mask=mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The conv over requests of any query length. x: [T, D] (rows may be strided, channels contiguous); weight:
    [D, K]; conv_states: [S, K - 1, D], updated at `state_slots`; out: [T, D], written. No host synchronisation."""
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    num_requests = state_slots.shape[0]
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.stride(1) == 1 and conv_states.stride(2) == 1
    if num_requests == 0:
        return
    if num_tokens:
        # each token's request, found on the device: the number of ends at or before it
        tokens = torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype)
        token_request = torch.searchsorted(query_start_loc[1:], tokens, right=True, out_int32=True)
        # (a verification graph's padding past the last request's tokens: a padded request's)
        token_request.clamp_(max=num_requests - 1)
        _causal_conv1d_kernel[(triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(dim, BLOCK_D))](
            out,
            x,
            weight,
            conv_states,
            query_start_loc,
            seq_lens,
            state_slots,
            token_request,
            num_tokens,
            x.stride(0),
            out.stride(0),
            weight.stride(0),
            conv_states.stride(0),
            conv_states.stride(1),
            D=dim,
            K=kernel_size,
            BLOCK_T=BLOCK_T,
            BLOCK_D=BLOCK_D,
            num_warps=4,
        )
    # NOTE: a second kernel, after every output is computed: the outputs of a request's first tokens read the old
    # state, which this overwrites
    _conv_state_kernel[(triton.cdiv(dim, BLOCK_D), num_requests)](
        conv_states,
        x,
        query_start_loc,
        seq_lens,
        state_slots,
        x.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        D=dim,
        K=kernel_size,
        ROWS_P=triton.next_power_of_2(kernel_size - 1),
        BLOCK_D=BLOCK_D,
        num_warps=4,
    )


@triton.jit
def _conv_update_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    conv_states_ptr,
    seq_lens_ptr,
    state_slots_ptr,
    stride_x_t,
    stride_o_t,
    stride_w_d,
    stride_s_slot,
    stride_s_row,
    D: tl.constexpr,
    K: tl.constexpr,
    ROWS_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program: one request's token (row = request), BLOCK_D channels; the state shifts by one row in place."""
    token = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, ROWS_P)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    # NOTE: a padded request (seq_lens 0) has no state: it reads zeros and writes the scratch slot
    has_state = tl.load(seq_lens_ptr + token) > 1
    slot = tl.load(state_slots_ptr + token).to(tl.int64)
    mask = (offs_r < K - 1)[:, None] & d_mask[None, :]
    state_ptrs = conv_states_ptr + slot * stride_s_slot + offs_r[:, None] * stride_s_row + offs_d[None, :]
    history = tl.load(state_ptrs, mask=tl.where(has_state, mask, False), other=0.0).to(tl.float32)
    # the state's rows 1.. (the next state's first K - 2 rows), read again rather than shifted in registers
    shifted_mask = tl.where(has_state, mask & (offs_r < K - 2)[:, None], False)
    shifted = tl.load(state_ptrs + stride_s_row, mask=shifted_mask, other=0.0)
    x = tl.load(x_ptr + token * stride_x_t + offs_d, mask=d_mask, other=0.0)
    weights = tl.load(weight_ptr + offs_d[None, :] * stride_w_d + offs_r[:, None], mask=mask, other=0.0)
    last_weight = tl.load(weight_ptr + offs_d * stride_w_d + K - 1, mask=d_mask, other=0.0).to(tl.float32)
    acc = tl.sum(history * weights.to(tl.float32), 0) + x.to(tl.float32) * last_weight
    tl.store(out_ptr + token * stride_o_t + offs_d, _silu(acc).to(out_ptr.dtype.element_ty), mask=d_mask)
    new_state = tl.where((offs_r == K - 2)[:, None], x.to(tl.float32)[None, :], shifted.to(tl.float32))
    tl.store(state_ptrs, new_state.to(conv_states_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One decode step: row i of x [B, D] is request i's token; its conv state at `state_slots[i]` shifts by one
    row in place. Shapes as `causal_conv1d`'s. Launches one kernel and nothing else (CUDA-graph safe)."""
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.stride(1) == 1 and conv_states.stride(2) == 1
    if num_tokens == 0:
        return
    _conv_update_kernel[(triton.cdiv(dim, BLOCK_D), num_tokens)](
        out,
        x,
        weight,
        conv_states,
        seq_lens,
        state_slots,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        D=dim,
        K=kernel_size,
        ROWS_P=triton.next_power_of_2(kernel_size - 1),
        BLOCK_D=BLOCK_D,
        num_warps=4,
    )
