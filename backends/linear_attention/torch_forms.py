"""Plain-torch forms of the Gated DeltaNet kernels: the CPU's, and what the Triton kernels are tested beside.

The layout is the engine's flat one: request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1] of every
input, its context (tokens processed before this step) is seq_lens[i] minus its query length, and
state_slots[i] is the row of the state tensors it reads (when its context is not empty) and writes. These forms walk
the requests on the host (`*_cpu` metadata), token by token; the Triton kernels do the same on the device.

    conv_states [S, K - 1, D]   the last K - 1 inputs of the causal conv, oldest first
    ssm_states  [S, Hv, Dk, Dv] the delta rule's matrix per value head, float32 (see op.py)

With speculative decoding the delta rule takes a `Fold` (op.py says why): request i first folds the first
counts[i] tokens its slot's record holds into the state it read, and where keep[i] is set writes that state back
instead of the one after its own tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Fold(NamedTuple):
    """Tokens of each slot's last verification step that the delta rule folds into the state before a request's own
    (op.py): per request, how many (`counts` [r] int32) and whether its own tokens are to be folded later instead
    (`keep` [r] int32: the state written back is the folded one); per slot, the record of up to P tokens: k [S, P,
    Hk, Dk] and v [S, P, Hv, Dv] (the conv's outputs), g and beta [S, P, Hv] float32."""

    counts: torch.Tensor
    keep: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


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
    fold: Fold | None = None,
) -> None:
    """The gated delta rule over each request's tokens, from its state (zeros without one), in float32:

        S = S * exp(g_t);  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = (scale q_t)^T S

    with q and k L2-normalised, value head h reading q/k head h // (Hv / Hk); the final S written to its slot
    (with a `fold`, see the module's docstring)."""
    group = v.shape[1] // q.shape[1]
    counts, keep = (fold.counts.tolist(), fold.keep.tolist()) if fold is not None else (None, None)
    for i, (start, num, has_state, slot) in enumerate(_requests(query_start_loc, seq_lens, state_slots)):
        state = states[slot].clone() if has_state else torch.zeros_like(states[slot])
        if fold is not None and counts[i]:
            n = counts[i]
            k_f = _l2norm(fold.k[slot, :n].float()).repeat_interleave(group, 1)
            state = _steps(state, k_f, fold.v[slot, :n].float(), fold.g[slot, :n], fold.beta[slot, :n])
        if fold is not None and keep[i]:
            states[slot] = state
        rows = slice(start, start + num)
        q_i = _l2norm(q[rows].float()).repeat_interleave(group, 1) * scale  # [num, Hv, Dk]
        k_i = _l2norm(k[rows].float()).repeat_interleave(group, 1)
        state = _steps(state, k_i, v[rows].float(), g[rows].float(), beta[rows].float(), q_i, out[rows])
        if fold is None or not keep[i]:
            states[slot] = state


def _steps(state, k, v, g, beta, q=None, out=None) -> torch.Tensor:
    """The delta rule's state after each of the tokens in turn (k normalised, [n, Hv, Dk]); with q, each token's
    output into `out`."""
    for t in range(k.shape[0]):
        state = state * g[t].float().exp()[:, None, None]
        kv = (k[t].unsqueeze(-1) * state).sum(1)  # [Hv, Dv]
        state = state + k[t].unsqueeze(-1) * (beta[t].float().unsqueeze(-1) * (v[t] - kv)).unsqueeze(1)
        if q is not None:
            out[t] = (q[t].unsqueeze(-1) * state).sum(1).to(out.dtype)
    return state


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
    """`chunk_gated_delta_rule` of one token a request (row i is request i)."""
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    chunk_gated_delta_rule(q, k, v, g, beta, states, starts, seq_lens, state_slots, scale, out, fold)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(z), as transformers' `Qwen3_5RMSNormGated` rounds it."""
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)
