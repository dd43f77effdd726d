"""The `kiln::gated_delta_net` custom op: a Gated DeltaNet layer's causal conv and delta rule over its recurrent state.

Like `kiln::unified_attention`, it is opaque to Dynamo (the compiled graph is split at it) and reads the step's
metadata from the forward context: which state slot each request holds (`AttentionMetadata.state_slots`) and the
layer's state tensors (`ForwardContext.recurrent_states`). Everything fusable around it (the projections, the gates'
softplus and sigmoid, the gated norm) stays in the compiled pieces.

    mixed_qkv [T, 2 Hk Dk + Hv Dv] ──conv1d + SiLU (conv state)──► q | k | v ──delta rule (ssm state)──► output

The delta rule's state is kept in float32: it is a running sum over the whole context, decayed and corrected at
every token, and bf16's 8 bits of mantissa would drift over thousands of steps (Qwen's and the
flash-linear-attention kernels keep it so).
"""

from __future__ import annotations

import functools

import torch

from kiln.backends.attention.forward_context import get_forward_context
from kiln.backends.linear_attention import torch_forms


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
        kernels.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, seq_lens, slots, scale, out)
    else:
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, ssm_states, starts, seq_lens, slots, scale, out)


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
