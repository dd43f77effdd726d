"""Gated DeltaNet's delta rule in Triton (forward only): the chunked prefill and the one-token decode step.

Per value head and token t, with S the [Dk, Dv] state (float32) and q, k L2-normalised in float32 (q then scaled):

    S = S * exp(g_t);   S = S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = S^T q_t

Value head h reads q/k head h // (Hv // Hk). Inputs are flat varlen rows (request i: rows
query_start_loc[i]:query_start_loc[i + 1]); request i reads `states[state_slots[i]]` when it has context
(seq_lens[i] > its query length), starts from zeros otherwise, and writes its final state back there. With
speculative decoding (a `Fold`, op.py) it first takes in the kept tokens of its slot's record, one at a time as the
decode step does, and a request verifying drafts writes back that state instead of its final one.

The prefill takes the chunked form (Gated DeltaNet, Yang, Kautz and Hatamizadeh, ICLR 2025). In a chunk of C = 64
tokens entered with state S0, with G_i = g_1 + ... + g_i (cumulative within the chunk):

    L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)  for j < i        A = (I + L)^-1  (the UT transform)
    v_new = A (beta v - (beta exp(G) k) S0)                        the values the chunk writes, corrected
    o     = (exp(G) q) S0 + [(q k^T) exp(G_i - G_j), j <= i] v_new
    S1    = exp(G_C) S0 + (exp(G_C - G) k)^T v_new

What hangs on no state is computed for every chunk at once by `_ut_transform_kernel`: A (its row-by-row
substitution is the serial part), the chunk's scores [(q k^T) exp(G_i - G_j), j <= i] and the rows' L2
normalisers, into float32 scratch of 2 x 64 + 2 floats a token and value head. `_chunk_scan_kernel` then walks each
request's chunks in order with a [Dk, BLOCK_V] slice of the state in registers. Every exponent is <= 0 (g <= 0), so
nothing overflows. With 16-bit q, k (bf16 models) the products with the float32 state take the state as two 16-bit
parts (`_dot_float32`): 16 bits of mantissa, on the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.backends.linear_attention.torch_forms import Fold

CHUNK = 64
# the chunk scan's launch: BLOCK_V (the state's columns a program keeps), warps, stages; at Dk = Dv = 128 this
# config spills no register (BLOCK_V 32 does at 4 warps)
SCAN_CONFIG = (16, 4, 2)
STEP_BLOCK_V = 32  # the decode step's: a Dk x 32 float32 slice is 32 registers a thread at 4 warps


@triton.jit
def _load_rows(base_ptr, rows, row_mask, stride_t, offs_k, DK: tl.constexpr):
    """Rows of one head as stored (masked rows 0): the kernels scale products by the rows' L2 normalisers rather
    than the rows, which stay 16-bit (a product of 16-bit rows is exact on the tensor cores)."""
    mask = row_mask[:, None] & (offs_k < DK)[None, :]
    return tl.load(base_ptr + rows[:, None].to(tl.int64) * stride_t + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _l2_normaliser(x):
    """1 / sqrt(sum(x * x) + 1e-6) of each row, in float32."""
    x32 = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x32 * x32, 1) + 1e-6)


@triton.jit
def _dot_float32(x, y, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """x @ y for rows x as stored and float32 y. SPLIT (16-bit x): y as the sum of two 16-bit parts (16 bits of
    mantissa between them), two exact products on the tensor cores that read x from shared memory as loaded (a float32
    copy of x [64, 128] would be 64 registers a thread, and spilled); else one product at PRECISION."""
    if SPLIT:
        high = y.to(x.dtype)
        low = (y - high.to(tl.float32)).to(x.dtype)
        return tl.dot(x, low, tl.dot(x, high))
    else:
        return tl.dot(x, y, input_precision=PRECISION)


@triton.jit
def _fold_record(
    state,
    n,
    slot,
    head,
    k_head,
    fk_ptr,
    fv_ptr,
    fg_ptr,
    fbeta_ptr,
    stride_fk_slot,
    stride_fk_t,
    stride_fk_h,
    stride_fv_slot,
    stride_fv_t,
    stride_fv_h,
    stride_fg_slot,
    stride_fg_t,
    offs_k,
    k_mask,
    offs_v,
    v_mask,
):
    """The state after the first n tokens of the slot's record (speculative decoding's kept tokens, op.py), one
    token at a time as the decode step takes them."""
    for t in range(0, n):
        k = tl.load(
            fk_ptr + slot * stride_fk_slot + t * stride_fk_t + k_head * stride_fk_h + offs_k, mask=k_mask, other=0.0
        )
        k = k.to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(
            fv_ptr + slot * stride_fv_slot + t * stride_fv_t + head * stride_fv_h + offs_v, mask=v_mask, other=0.0
        )
        at = slot * stride_fg_slot + t * stride_fg_t + head
        state = state * tl.exp(tl.load(fg_ptr + at))
        predicted = tl.sum(k[:, None] * state, 0)
        state += k[:, None] * (tl.load(fbeta_ptr + at) * (v.to(tl.float32) - predicted))[None, :]
    return state


@triton.jit
def _ut_transform_kernel(
    a_ptr,  # [T, Hv, CHUNK] float32: row t holds row (t - chunk start) of its chunk's A
    scores_ptr,  # as a_ptr: the same rows of the chunk's (q k^T) exp(G_i - G_j), j <= i
    norms_ptr,  # [T, Hv, 2] float32: row t's normalisers of q (times the scale) and k
    q_ptr,
    k_ptr,
    g_ptr,
    beta_ptr,
    query_start_loc_ptr,
    chunk_request_ptr,  # [max_chunks] the request of each chunk (num_requests past the last chunk)
    first_chunk_ptr,  # [B] each request's first chunk
    scale,
    num_requests,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_g_t,
    stride_beta_t,
    stride_a_t,
    stride_a_h,
    stride_n_t,
    Q_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program: one chunk of one value head. A = (I + L)^-1 by forward substitution, row i from rows < i:
    A[i] = e_i - sum_j L[i, j] A[j] (A is unit lower triangular; the loop builds its strict part). Also what the
    scan would otherwise compute in registers beside its state, and spill: the chunk's scores and the rows'
    normalisers."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(chunk_request_ptr + chunk)
    if request >= num_requests:
        return  # the grid is sized for the most chunks T tokens can make
    end = tl.load(query_start_loc_ptr + request + 1)
    chunk_start = tl.load(query_start_loc_ptr + request) + (chunk - tl.load(first_chunk_ptr + request)) * CHUNK
    length = tl.minimum(end - chunk_start, CHUNK)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, DK_P)
    rows = chunk_start + offs_c
    row_mask = offs_c < length
    k_head = head // Q_PER_K
    k = _load_rows(k_ptr + k_head * stride_k_h, rows, row_mask, stride_k_t, offs_k, DK)
    q = _load_rows(q_ptr + k_head * stride_q_h, rows, row_mask, stride_q_t, offs_k, DK)
    k_scale = _l2_normaliser(k)
    q_scale = _l2_normaliser(q) * scale
    norms_ptrs = norms_ptr + rows.to(tl.int64) * stride_n_t + head * 2
    tl.store(norms_ptrs, q_scale, mask=row_mask)
    tl.store(norms_ptrs + 1, k_scale, mask=row_mask)
    g_cum = tl.cumsum(tl.load(g_ptr + rows * stride_g_t + head, mask=row_mask, other=0.0), 0)
    pair = rows[:, None].to(tl.int64) * stride_a_t + head * stride_a_h + offs_c[None, :]
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (never exp of a positive number)
    decay = tl.exp(tl.where(offs_c[:, None] >= offs_c[None, :], g_cum[:, None] - g_cum[None, :], float("-inf")))
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * q_scale[:, None] * k_scale[None, :] * decay
    tl.store(scores_ptr + pair, scores, mask=row_mask[:, None])
    beta = tl.load(beta_ptr + rows * stride_beta_t + head, mask=row_mask, other=0.0).to(tl.float32)
    below = offs_c[:, None] > offs_c[None, :]
    lower = tl.dot(k, tl.trans(k), input_precision=PRECISION) * k_scale[:, None] * k_scale[None, :]
    lower = tl.where(below, lower * decay * beta[:, None], 0.0)
    inverse = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    for i in range(1, length):
        row = -tl.sum(tl.where(offs_c[:, None] == i, lower, 0.0), 0)
        row += tl.sum(row[:, None] * inverse, 0)
        inverse = tl.where(offs_c[:, None] == i, row[None, :], inverse)
    inverse += tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    tl.store(a_ptr + pair, inverse, mask=row_mask[:, None])


@triton.jit
def _chunk_scan_kernel(
    out_ptr,
    states_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    a_ptr,
    scores_ptr,
    norms_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    state_slots_ptr,
    counts_ptr,
    keep_ptr,
    fk_ptr,
    fv_ptr,
    fg_ptr,
    fbeta_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_g_t,
    stride_beta_t,
    stride_a_t,
    stride_a_h,
    stride_n_t,
    stride_o_t,
    stride_o_h,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    stride_fk_slot,
    stride_fk_t,
    stride_fk_h,
    stride_fv_slot,
    stride_fv_t,
    stride_fv_h,
    stride_fg_slot,
    stride_fg_t,
    Q_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DK_P: tl.constexpr,
    DV: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    FOLD: tl.constexpr,
):
    """Program: one request, one value head, BLOCK_V of the state's columns; the request's chunks in order."""
    head = tl.program_id(1)
    request = tl.program_id(2)
    k_head = head // Q_PER_K
    start = tl.load(query_start_loc_ptr + request)
    end = tl.load(query_start_loc_ptr + request + 1)
    has_state = tl.load(seq_lens_ptr + request) - (end - start) > 0
    slot = tl.load(state_slots_ptr + request).to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, DK_P)
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < DV
    state_ptrs = states_ptr + slot * stride_s_slot + head * stride_s_h + offs_k[:, None] * stride_s_k + offs_v[None, :]
    state_mask = (offs_k < DK)[:, None] & v_mask[None, :]
    # (tl.where: Triton's interpreter refuses a tensor mask and-ed with a loaded scalar)
    state = tl.load(state_ptrs, mask=tl.where(has_state, state_mask, False), other=0.0)
    keep = 0
    if FOLD:
        state = _fold_record(
            state,
            tl.load(counts_ptr + request),
            slot,
            head,
            k_head,
            fk_ptr,
            fv_ptr,
            fg_ptr,
            fbeta_ptr,
            stride_fk_slot,
            stride_fk_t,
            stride_fk_h,
            stride_fv_slot,
            stride_fv_t,
            stride_fv_h,
            stride_fg_slot,
            stride_fg_t,
            offs_k,
            offs_k < DK,
            offs_v,
            v_mask,
        )
        keep = tl.load(keep_ptr + request)
        tl.store(state_ptrs, state, mask=tl.where(keep != 0, state_mask, False))
    for chunk_start in range(start, end, CHUNK):
        rows = chunk_start + offs_c
        row_mask = rows < end
        # NOTE: rows past the request load g = 0, so g_cum's last entry is the whole chunk's decay
        g_cum = tl.cumsum(tl.load(g_ptr + rows * stride_g_t + head, mask=row_mask, other=0.0), 0)
        decay_in = tl.exp(g_cum)  # from the chunk's start through row i
        beta = tl.load(beta_ptr + rows * stride_beta_t + head, mask=row_mask, other=0.0).to(tl.float32)
        norms_ptrs = norms_ptr + rows.to(tl.int64) * stride_n_t + head * 2
        q_scale = tl.load(norms_ptrs, mask=row_mask, other=0.0)
        k_scale = tl.load(norms_ptrs + 1, mask=row_mask, other=0.0)
        q = _load_rows(q_ptr + k_head * stride_q_h, rows, row_mask, stride_q_t, offs_k, DK)
        k = _load_rows(k_ptr + k_head * stride_k_h, rows, row_mask, stride_k_t, offs_k, DK)
        o = _dot_float32(q, state, SPLIT, PRECISION) * (q_scale * decay_in)[:, None]
        # what each row writes, less what the state at the chunk's start already predicts; then the UT transform
        v_ptrs = v_ptr + rows[:, None].to(tl.int64) * stride_v_t + head * stride_v_h + offs_v[None, :]
        v = tl.load(v_ptrs, mask=row_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        predicted = _dot_float32(k, state, SPLIT, PRECISION) * (k_scale * decay_in)[:, None]
        pair = rows[:, None].to(tl.int64) * stride_a_t + head * stride_a_h + offs_c[None, :]
        a = tl.load(a_ptr + pair, mask=row_mask[:, None], other=0.0)
        v_new = tl.dot(a, (v - predicted) * beta[:, None], input_precision=PRECISION)
        scores = tl.load(scores_ptr + pair, mask=row_mask[:, None], other=0.0)
        o += tl.dot(scores, v_new, input_precision=PRECISION)
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o_t + head * stride_o_h + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & v_mask[None, :])
        g_last = tl.sum(tl.where(offs_c == CHUNK - 1, g_cum, 0.0), 0)
        v_write = v_new * (k_scale * tl.exp(g_last - g_cum))[:, None]
        state = state * tl.exp(g_last) + _dot_float32(tl.trans(k), v_write, SPLIT, PRECISION)
    tl.store(state_ptrs, state, mask=tl.where(keep != 0, False, state_mask))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models get exact float32 products; 16-bit ones TF32's tensor cores (a 10-bit mantissa, finer than bf16's)
    return "ieee" if dtype == torch.float32 else "tf32"


def _fold_args(fold: Fold | None, states: torch.Tensor) -> tuple[list, list]:
    """A kernel's fold pointers and strides (any tensor's and zeros without a fold: FOLD is then off)."""
    if fold is None:
        return [states] * 6, [0] * 8
    assert fold.g.stride() == fold.beta.stride() and fold.g.stride(-1) == 1 and fold.k.stride(-1) == 1
    pointers = [fold.counts, fold.keep, fold.k, fold.v, fold.g, fold.beta]
    strides = [*fold.k.stride()[:3], *fold.v.stride()[:3], *fold.g.stride()[:2]]
    return pointers, strides


def _check_layout(q, k, v, states, out) -> None:
    for t in (q, k, v, out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    assert states.dtype == torch.float32 and states.stride(-1) == 1 and states.stride(-2) == states.shape[-1]
    assert v.shape[1] % k.shape[1] == 0, "value heads must be a multiple of key heads"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    fold: Fold | None = None,
) -> None:
    """The delta rule over requests of any query length (prefill, mixed with one-token requests), chunked.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g: [T, Hv] float32 (log decay, <= 0); beta: [T, Hv]; states:
    [S, Hv, Dk, Dv] float32, updated at `state_slots`; out: [T, Hv, Dv], written; `fold`: torch_forms.Fold's.
    No host synchronisation."""
    _check_layout(q, k, v, states, out)
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    num_requests = state_slots.shape[0]
    if num_requests == 0:
        return
    # Each request's tokens cut into CHUNK-token chunks; a chunk's request found on the device (no host read): the
    # grid is sized for the most chunks T tokens can make, and programs past the last chunk return.
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    chunks = torch.div(q_lens + CHUNK - 1, CHUNK, rounding_mode="floor")
    chunk_ends = torch.cumsum(chunks, 0)
    max_chunks = triton.cdiv(num_tokens, CHUNK) + num_requests
    chunk_ids = torch.arange(max_chunks, device=q.device, dtype=chunk_ends.dtype)
    chunk_request = torch.searchsorted(chunk_ends, chunk_ids, right=True, out_int32=True)
    first_chunk = (chunk_ends - chunks).to(torch.int32)
    a = torch.empty(num_tokens, num_v_heads, CHUNK, dtype=torch.float32, device=q.device)
    scores = torch.empty_like(a)
    norms = torch.empty(num_tokens, num_v_heads, 2, dtype=torch.float32, device=q.device)
    q_per_k = num_v_heads // num_k_heads
    dk_p = max(16, triton.next_power_of_2(dk))  # (tl.dot's least size)
    precision = _dot_precision(out.dtype)
    _ut_transform_kernel[(max_chunks, num_v_heads)](
        a,
        scores,
        norms,
        q,
        k,
        g,
        beta,
        query_start_loc,
        chunk_request,
        first_chunk,
        scale,
        num_requests,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        g.stride(0),
        beta.stride(0),
        a.stride(0),
        a.stride(1),
        norms.stride(0),
        Q_PER_K=q_per_k,
        DK=dk,
        DK_P=dk_p,
        CHUNK=CHUNK,
        PRECISION=precision,
        num_warps=4,
    )
    fold_pointers, fold_strides = _fold_args(fold, states)
    block_v, warps, stages = SCAN_CONFIG
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _chunk_scan_kernel[(triton.cdiv(dv, block_v), num_v_heads, num_requests)](
        out,
        states,
        q,
        k,
        v,
        g,
        beta,
        a,
        scores,
        norms,
        query_start_loc,
        seq_lens,
        state_slots,
        *fold_pointers,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        a.stride(0),
        a.stride(1),
        norms.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        *fold_strides,
        Q_PER_K=q_per_k,
        DK=dk,
        DK_P=dk_p,
        DV=dv,
        CHUNK=CHUNK,
        BLOCK_V=block_v,
        PRECISION=precision,
        SPLIT=q.dtype != torch.float32,
        FOLD=fold is not None,
        num_warps=warps,
        num_stages=stages,
    )


@triton.jit
def _recurrent_kernel(
    out_ptr,
    states_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    seq_lens_ptr,
    state_slots_ptr,
    counts_ptr,
    keep_ptr,
    fk_ptr,
    fv_ptr,
    fg_ptr,
    fbeta_ptr,
    scale,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_g_t,
    stride_beta_t,
    stride_o_t,
    stride_o_h,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    stride_fk_slot,
    stride_fk_t,
    stride_fk_h,
    stride_fv_slot,
    stride_fv_t,
    stride_fv_h,
    stride_fg_slot,
    stride_fg_t,
    Q_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DK_P: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FOLD: tl.constexpr,
):
    """Program: one request's token (row = request), one value head, BLOCK_V of the state's columns."""
    head = tl.program_id(1)
    token = tl.program_id(2).to(tl.int64)
    k_head = head // Q_PER_K
    # NOTE: a padded request (seq_lens 0) has no state: it starts from zeros and writes the scratch slot
    has_state = tl.load(seq_lens_ptr + token) > 1
    slot = tl.load(state_slots_ptr + token).to(tl.int64)
    offs_k = tl.arange(0, DK_P)
    k_mask = offs_k < DK
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < DV
    q = tl.load(q_ptr + token * stride_q_t + k_head * stride_q_h + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
    k = tl.load(k_ptr + token * stride_k_t + k_head * stride_k_h + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + token * stride_v_t + head * stride_v_h + offs_v, mask=v_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + token * stride_g_t + head))
    beta = tl.load(beta_ptr + token * stride_beta_t + head).to(tl.float32)
    state_ptrs = states_ptr + slot * stride_s_slot + head * stride_s_h + offs_k[:, None] * stride_s_k + offs_v[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_ptrs, mask=tl.where(has_state, state_mask, False), other=0.0)
    keep = 0
    if FOLD:
        state = _fold_record(
            state,
            tl.load(counts_ptr + token),
            slot,
            head,
            k_head,
            fk_ptr,
            fv_ptr,
            fg_ptr,
            fbeta_ptr,
            stride_fk_slot,
            stride_fk_t,
            stride_fk_h,
            stride_fv_slot,
            stride_fv_t,
            stride_fv_h,
            stride_fg_slot,
            stride_fg_t,
            offs_k,
            k_mask,
            offs_v,
            v_mask,
        )
        keep = tl.load(keep_ptr + token)
        tl.store(state_ptrs, state, mask=tl.where(keep != 0, state_mask, False))
    state = state * decay
    predicted = tl.sum(k[:, None] * state, 0)
    state += k[:, None] * (beta * (v - predicted))[None, :]
    o = tl.sum(q[:, None] * state, 0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_v, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptrs, state, mask=tl.where(keep != 0, False, state_mask))


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    fold: Fold | None = None,
) -> None:
    """One decode step: row i is request i's one token (T == B); its state is updated in place at
    `state_slots[i]`. Shapes as `chunk_gated_delta_rule`'s. Launches one kernel and nothing else (CUDA-graph safe)."""
    _check_layout(q, k, v, states, out)
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    if num_tokens == 0:
        return
    block_v = min(STEP_BLOCK_V, triton.next_power_of_2(dv))
    fold_pointers, fold_strides = _fold_args(fold, states)
    _recurrent_kernel[(triton.cdiv(dv, block_v), num_v_heads, num_tokens)](
        out,
        states,
        q,
        k,
        v,
        g,
        beta,
        seq_lens,
        state_slots,
        *fold_pointers,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        *fold_strides,
        Q_PER_K=num_v_heads // num_k_heads,
        DK=dk,
        DK_P=triton.next_power_of_2(dk),
        DV=dv,
        BLOCK_V=block_v,
        FOLD=fold is not None,
        num_warps=4,
    )
