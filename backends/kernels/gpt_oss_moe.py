"""`kiln::gpt_oss_moe`: gpt-oss's routing and experts, from the router's logits (its matmul is ordinary torch before
the op).

    gpt_oss_moe(x [T, H], router_logits [T, E], top_k, w13 [E, 2I, H], w13_bias [E, 2I], w2 [E, H, I],
                w2_bias [E, H] or None, alpha, limit, w13_scale = None, w2_scale = None)
        -> [T, H] = sum over j < k of  weights[t, j] * (w2[e] @ act(w13[e] @ x_t + w13_bias[e]) + w2_bias[e])
    experts e = the top k of the token's logits, weights = the softmax of those k (as Hugging Face routes: the same
    as the top k of the softmax over every expert, renormalised, which the GPU's routing kernel computes)
    act(gate, up) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),   g = min(gate, limit)
    w13: the gate's rows, then the up projection's. With scales the weights are MXFP4 (mxfp4.py): w13 [E, 2I, H/2]
    and w2 [E, H, I/2] uint8, two e2m1 values a byte, w13_scale [E, 2I, H/32] and w2_scale [E, H, I/32] uint8.

One opaque op, as `kiln::fused_moe` is. On the GPU the Triton kernels (gpt_oss_moe_triton.py: the pairs laid out by
expert, two grouped matmuls that read only the chosen experts' weights, MXFP4 dequantized in registers, the biases, the
clamped SwiGLU and the routing weight in their epilogues); the plain torch here, a loop over the chosen experts as
Hugging Face computes them, is the CPU's form and the tests' reference. With tensor parallelism each rank holds its
columns of the intermediate dimension and only one rank adds the down projection's bias (`w2_bias` None on the others).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kiln.backends.kernels import mxfp4
from kiln.backends.kernels.ops import define


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """act of the gate's and the up projection's outputs side by side [.., 2I] (see the module's docstring)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(NamedTuple):
    """One layer's experts as the op takes them (this rank's columns of the intermediate dimension), its SwiGLU's
    alpha and clamp; MXFP4 weights come with their scales."""

    w13: torch.Tensor
    w13_bias: torch.Tensor
    w2: torch.Tensor
    w2_bias: torch.Tensor | None
    alpha: float
    limit: float
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


def gpt_oss_moe_reference(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, layer: Experts
) -> torch.Tensor:
    """Expert by expert (MXFP4 weights dequantized as each is used), each one's weighted output added into the tokens
    that chose it."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        tokens, slot = torch.where(experts == expert)
        up_weight, down_weight = layer.w13[expert], layer.w2[expert]
        if layer.w13_scale is not None:
            up_weight = mxfp4.dequantize(up_weight, layer.w13_scale[expert], x.dtype)
            down_weight = mxfp4.dequantize(down_weight, layer.w2_scale[expert], x.dtype)
        act = clamped_swiglu(F.linear(x[tokens], up_weight, layer.w13_bias[expert]), layer.alpha, layer.limit)
        y = F.linear(act, down_weight, None if layer.w2_bias is None else layer.w2_bias[expert])
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k] int32) as Hugging Face's gpt-oss routes."""
    top, experts = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1), experts.to(torch.int32)


def _gpt_oss_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    w13: torch.Tensor,
    w13_bias: torch.Tensor,
    w2: torch.Tensor,
    w2_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    layer = Experts(w13, w13_bias, w2, w2_bias, alpha, limit, w13_scale, w2_scale)  # (the op's arguments are flat)
    if x.is_cuda:
        from kiln.backends.kernels.gpt_oss_moe_triton import routed_gpt_oss_moe  # noqa: PLC0415  (Triton on a GPU)

        return routed_gpt_oss_moe(x, router_logits, top_k, layer)
    return gpt_oss_moe_reference(x, *route(router_logits, top_k), layer)


def _gpt_oss_moe_fake(x: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(x.shape)


define(
    "gpt_oss_moe(Tensor x, Tensor router_logits, int top_k, Tensor w13, Tensor w13_bias, Tensor w2, Tensor? w2_bias, "
    "float alpha, float limit, Tensor? w13_scale=None, Tensor? w2_scale=None) -> Tensor",
    _gpt_oss_moe,
    _gpt_oss_moe_fake,
)
