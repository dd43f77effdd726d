"""`kiln::fused_moe`: the experts of a mixture-of-experts layer, for tokens routed to k of them each.

    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], experts [T, k] int32) -> [T, H]
        = sum over j < k of  weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t),  e = experts[t, j]

One opaque op, as the attention is: Dynamo traces the router around it and Inductor fuses that; the op's
GPU form is the grouped Triton kernel (moe_triton.py), which reads only the experts some token chose and runs
inside CUDA graphs (fixed shapes, no host sync). `fused_moe_reference` is the plain-torch form: a loop over
the experts that were chosen, as Hugging Face computes it (the CPU's form, and the tests' reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.backends.kernels.ops import define


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Expert by expert, adding each one's weighted output into the tokens that chose it (in expert order)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        tokens, slot = torch.where(experts == expert)
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    if x.is_cuda:
        from kiln.backends.kernels.moe_triton import fused_moe  # noqa: PLC0415  (Triton only where there is a GPU)

        return fused_moe(x, w13, w2, weights, experts)
    return fused_moe_reference(x, w13, w2, weights, experts)


def _fused_moe_fake(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape)


define(
    "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor experts) -> Tensor",
    _fused_moe,
    _fused_moe_fake,
)
