"""Plain-torch forms of the Gated DeltaNet kernels: the CPU's, and what the Triton kernels are tested beside.

The layout is the engine's flat one: request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1] of every
input, its context (tokens processed before this step) is seq_lens[i] minus its query length, and
state_slots[i] is the row of the state tensors it reads (when its context is not empty) and writes. These forms walk
the requests on the host (`*_cpu` metadata), token by token; the Triton kernels do the same on the device.

    conv_states [S, K - 1, D]   the last K - 1 inputs of the causal conv, oldest first
    ssm_states  [S, Hv, Dk, Dv] the delta rule's matrix per value head, float32 (see op.py)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor):
    """(first row, rows, has state, slot) of each request, from host tensors."""
    starts, lens, slots = query_start_loc.tolist(), seq_lens.tolist(), state_slots.tolist()
    for i, slot in enumerate(slots):
        num = starts[i + 1] - starts[i]
        yield starts[i], num, lens[i] > num, slot


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t] = silu(sum_j weight[:, j] * history[t - (K - 1) + j]) over each request's history (its conv state, then
    its tokens), in the weight's dtype as transformers' `causal_conv1d_fn`; the state keeps the last K - 1 rows."""
    width = weight.shape[1] - 1
    for start, num, has_state, slot in _requests(query_start_loc, seq_lens, state_slots):
        tokens = x[start : start + num]
        before = conv_states[slot] if has_state else torch.zeros_like(conv_states[slot])
        history = torch.cat([before.to(weight.dtype), tokens.to(weight.dtype)])  # [K - 1 + num, D]
        windows = history.unfold(0, width + 1, 1)  # [num, D, K]
        out[start : start + num] = F.silu((windows * weight).sum(-1)).to(out.dtype)
        conv_states[slot] = history[-width:].to(conv_states.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`causal_conv1d` of one token a request (row i is request i)."""
    starts = torch.arange(x.shape[0] + 1, dtype=torch.int32)
    causal_conv1d(x, weight, conv_states, starts, seq_lens, state_slots, out)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


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
) -> None:
    """The gated delta rule over each request's tokens, from its state (zeros without one), in float32:

        S = S * exp(g_t);  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = (scale q_t)^T S

    with q and k L2-normalised, value head h reading q/k head h // (Hv / Hk); the final S written to its slot."""
    group = v.shape[1] // q.shape[1]
    for start, num, has_state, slot in _requests(query_start_loc, seq_lens, state_slots):
        rows = slice(start, start + num)
        q_i = _l2norm(q[rows].float()).repeat_interleave(group, 1) * scale  # [num, Hv, Dk]
        k_i = _l2norm(k[rows].float()).repeat_interleave(group, 1)
        v_i, g_i, beta_i = v[rows].float(), g[rows].float(), beta[rows].float()
        state = states[slot].clone() if has_state else torch.zeros_like(states[slot])
        for t in range(num):
            state = state * g_i[t].exp()[:, None, None]
            kv = (k_i[t].unsqueeze(-1) * state).sum(1)  # [Hv, Dv]
            state = state + k_i[t].unsqueeze(-1) * (beta_i[t].unsqueeze(-1) * (v_i[t] - kv)).unsqueeze(1)
            out[start + t] = (q_i[t].unsqueeze(-1) * state).sum(1).to(out.dtype)
        states[slot] = state


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
) -> None:
    """`chunk_gated_delta_rule` of one token a request (row i is request i)."""
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    chunk_gated_delta_rule(q, k, v, g, beta, states, starts, seq_lens, state_slots, scale, out)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(z), as transformers' `Qwen3_5RMSNormGated` rounds it."""
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)
