"""`kiln::fused_moe`: a mixture-of-experts layer's routing and experts, from the router's logits.

    fused_moe(x [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], top_k, renormalise, float32_weights,
              expert_scales [E] = None, gelu = False)
        -> [T, H] = sum over j < k of  weights[t, j] * w2[e] @ (act(gate_e x_t) * up_e x_t),  e = experts[t, j]
    experts, weights: the top-k of softmax(router_logits) (float32), divided by their sum if `renormalise`, in
    float32 (Mixtral, Gemma 4) or x's dtype (the Qwen models), as Hugging Face rounds them, then times each chosen
    expert's scale where there are `expert_scales` (Gemma 4's); act: SiLU, or GELU's tanh form with `gelu` (Gemma 4)

One opaque op, as the attention is (Dynamo traces the router's matmul before it). Its GPU form is Triton's
(moe_routing.py, moe_triton.py): routing and alignment in one launch for a decode, then grouped matmuls that read
only the experts some token chose, inside CUDA graphs (fixed shapes, no host sync). The plain-torch form
(`route_reference` in moe_routing.py, `fused_moe_reference` here: a loop over the chosen experts, as Hugging Face
computes it) is the CPU's, and the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.backends.kernels.moe_routing import route_reference
from kiln.backends.kernels.ops import define


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gelu: bool = False,
) -> torch.Tensor:
    """Expert by expert, adding each one's weighted output into the tokens that chose it (in expert order)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        tokens, slot = torch.where(experts == expert)
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        y = F.linear(act * up, w2[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalise: bool,
    float32_weights: bool,
    expert_scales: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    weights_dtype = torch.float32 if float32_weights else x.dtype
    if x.is_cuda:
        from kiln.backends.kernels.moe_triton import fused_moe  # noqa: PLC0415  (Triton only where there is a GPU)

        return fused_moe(x, router_logits, w13, w2, top_k, renormalise, weights_dtype, None, expert_scales, gelu)
    weights, experts = route_reference(router_logits, top_k, renormalise, weights_dtype)
    if expert_scales is not None:
        weights = weights * expert_scales[experts]
    return fused_moe_reference(x, w13, w2, weights, experts, gelu)


def _fused_moe_fake(x: torch.Tensor, router_logits: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(x.shape)


define(
    "fused_moe(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, int top_k, bool renormalise, "
    "bool float32_weights, Tensor? expert_scales=None, bool gelu=False) -> Tensor",
    _fused_moe,
    _fused_moe_fake,
)
