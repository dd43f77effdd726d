"""The `kiln::gated_delta_net` custom op: a Gated DeltaNet layer's causal conv and delta rule over its recurrent state.

Like `kiln::unified_attention`, it is opaque to Dynamo (the compiled graph is split at it) and reads the step's
metadata from the forward context: which state slot each request holds (`AttentionMetadata.state_slots`) and the
layer's state tensors (`ForwardContext.recurrent_states`). Everything fusable around it (the projections, the gates'
softplus and sigmoid, the gated norm) stays in the compiled pieces.

    mixed_qkv [T, 2 Hk Dk + Hv Dv] ──conv1d + SiLU (conv state)──► q | k | v ──delta rule (ssm state)──► output

The delta rule's state is kept in float32: it is a running sum over the whole context, decayed and corrected at
every token, and bf16's 8 bits of mantissa would drift over thousands of steps (Qwen's and the
flash-linear-attention kernels keep it so).

Speculative decoding: a step verifying drafts cannot know which of its tokens the model keeps, and a state cannot
drop tokens. So such a request (`state_folds[1]`, keep) writes back the state it started from, and records its
tokens in its slot's `DraftRecord` (the conv's inputs after the window it started from, the conv's outputs, g and
beta); its next step first folds in the ones kept (`state_folds[0]`, how many: its input and kept drafts, which the
device knows before the next step reads it, so the host may schedule that step before the verdict).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kiln.backends.attention.forward_context import get_forward_context
from kiln.backends.linear_attention import torch_forms
from kiln.backends.linear_attention.torch_forms import Fold


class DraftRecord(NamedTuple):
    """A Gated DeltaNet layer's record of each slot's last step (speculative decoding), P = 1 + k tokens a slot."""

    window: torch.Tensor  # [S, K - 1 + P, conv_dim]: the conv state the step started from, then its inputs
    conv_out: torch.Tensor  # [S, P, conv_dim]: the conv's outputs (q | k | v)
    g: torch.Tensor  # [S, P, Hv] float32
    beta: torch.Tensor  # [S, P, Hv] float32


class _TritonKernels:
    """The Triton kernels, imported on the first GPU step (the CPU never loads them)."""

    def __init__(self) -> None:
        from kiln.backends.linear_attention import triton_conv, triton_delta_rule  # noqa: PLC0415

        self.causal_conv1d = triton_conv.causal_conv1d
        self.causal_conv1d_update = triton_conv.causal_conv1d_update
        self.chunk_gated_delta_rule = triton_delta_rule.chunk_gated_delta_rule
        self.recurrent_gated_delta_rule = triton_delta_rule.recurrent_gated_delta_rule


@functools.cache
def _triton_kernels() -> _TritonKernels:
    return _TritonKernels()


def _kernels(device: torch.device):
    """The Triton kernels on the GPU, the plain-torch forms elsewhere."""
    return _triton_kernels() if device.type == "cuda" else torch_forms


def gated_delta_net(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    output: torch.Tensor,
    state_index: int,
) -> None:
    """The op's body: `output` [T, Hv, Dv] of the layer whose states are `recurrent_states[state_index]`."""
    context = get_forward_context()
    conv_states, ssm_states = context.recurrent_states[state_index]
    metadata = context.attn_metadata
    kernels = _kernels(mixed_qkv.device)
    num_value_heads, head_k_dim, head_v_dim = ssm_states.shape[1:]
    key_dim = (mixed_qkv.shape[1] - num_value_heads * head_v_dim) // 2
    num_tokens = metadata.num_actual_tokens
    x = mixed_qkv[:num_tokens]
    conv_out = torch.empty_like(x)
    out = output[:num_tokens]
    decode = metadata.max_query_len == 1  # one token a request, row i request i (a full CUDA graph's case)
    on_device = mixed_qkv.device.type == "cuda"
    seq_lens = metadata.seq_lens if on_device else metadata.seq_lens_cpu
    slots = metadata.state_slots if on_device else metadata.state_slots_cpu
    starts = metadata.query_start_loc if on_device else metadata.query_start_loc_cpu
    record = context.draft_records[state_index] if context.draft_records else None
    fold = None
    if record is not None:
        plan = metadata.derived.get("draft_plan")
        if plan is None:  # (the same for every linear layer of the step)
            plan = metadata.derived["draft_plan"] = _plan(metadata, record, starts, slots, num_tokens, decode)
        _fold_window(record, conv_states, plan)
        record.window.view(-1, record.window.shape[-1]).index_copy_(0, plan.window_rows, x)
        counts, keep = metadata.state_folds
        fold = Fold(
            counts,
            keep,
            record.conv_out[:, :, key_dim : 2 * key_dim].unflatten(-1, (-1, head_k_dim)),
            record.conv_out[:, :, 2 * key_dim :].unflatten(-1, (num_value_heads, head_v_dim)),
            record.g,
            record.beta,
        )
    if decode:
        kernels.causal_conv1d_update(x, conv_weight, conv_states, seq_lens, slots, conv_out)
    else:
        kernels.causal_conv1d(x, conv_weight, conv_states, starts, seq_lens, slots, conv_out)
    q, k, v = conv_out.split([key_dim, key_dim, num_value_heads * head_v_dim], dim=1)
    q = q.view(num_tokens, -1, head_k_dim)
    k = k.view(num_tokens, -1, head_k_dim)
    v = v.view(num_tokens, num_value_heads, head_v_dim)
    scale = head_k_dim**-0.5
    g, beta = g[:num_tokens], beta[:num_tokens]
    if decode:
        kernels.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, seq_lens, slots, scale, out, fold)
    else:
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, ssm_states, starts, seq_lens, slots, scale, out, fold)
    if record is not None:  # (after the delta rule, which read the last step's record)
        record.conv_out.view(-1, record.conv_out.shape[-1]).index_copy_(0, plan.record_rows, conv_out)
        record.g.view(-1, num_value_heads).index_copy_(0, plan.record_rows, g.float())
        record.beta.view(-1, num_value_heads).index_copy_(0, plan.record_rows, beta.float())


class _Plan(NamedTuple):
    """A step's rows of the draft records, the same for every linear layer (op.py's `_plan`)."""

    slots: torch.Tensor  # [r] int64
    folds: torch.Tensor  # [r, 1, 1] bool: the request folds kept tokens in
    window_index: torch.Tensor  # [r, K - 1, conv_dim] int64: its conv state's rows in its window, once folded
    record_rows: torch.Tensor  # [T] int64: each token's row in its slot's flat record [S * P]
    window_rows: torch.Tensor  # [T] int64: ... and in its flat window [S * (K - 1 + P)]


def _plan(metadata, record: DraftRecord, starts, slots, num_tokens: int, decode: bool) -> _Plan:
    """Each token's record and window rows: its place in its request, for the first P of every request's tokens
    (only a verifying request's are read, and it has no more; the rest go to the scratch slot's rows); and where a
    folding request's conv state lies in its window. On the device, without a host read (a full CUDA graph captures
    it)."""
    slots = slots.long()
    token = torch.arange(num_tokens, device=slots.device)
    if decode:
        request, place = token, torch.zeros_like(token)
    else:  # (a full graph's padding past the last request's tokens: scratch)
        request = torch.searchsorted(starts[1:], token.to(starts.dtype), right=True).clamp_(max=slots.shape[0] - 1)
        place = token - starts.index_select(0, request)
    slot = slots.index_select(0, request)
    _, window_rows, dim = record.window.shape
    places = record.conv_out.shape[1]
    inside = (place < places) & (token < starts[-1])
    width = window_rows - places
    n = metadata.state_folds[0].long()
    window_index = (n[:, None] + torch.arange(width, device=n.device)).unsqueeze(-1).expand(-1, -1, dim)
    return _Plan(
        slots,
        (n > 0)[:, None, None],
        window_index,
        torch.where(inside, slot * places + place, 0),
        torch.where(inside, slot * window_rows + width + place, 0),
    )


def _fold_window(record: DraftRecord, conv_states: torch.Tensor, plan: _Plan) -> None:
    """Before the conv: a request folding n kept tokens takes its conv state from its record's window (the K - 1
    inputs after the first n of its last step's); every request's window then starts from the state it now has."""
    width = conv_states.shape[1]
    shifted = record.window.index_select(0, plan.slots).gather(1, plan.window_index)
    folded = torch.where(plan.folds, shifted, conv_states.index_select(0, plan.slots))
    conv_states.index_copy_(0, plan.slots, folded)
    record.window[:, :width].index_copy_(0, plan.slots, folded)


@torch.library.custom_op("kiln::gated_delta_net", mutates_args=("output",))
def gated_delta_net_op(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    output: torch.Tensor,
    state_index: int,
) -> None:
    gated_delta_net(mixed_qkv, g, beta, conv_weight, output, state_index)


@gated_delta_net_op.register_fake
def _(mixed_qkv, g, beta, conv_weight, output, state_index: int) -> None:
    return None
