"""`kiln::fused_moe_fp8`: `kiln::fused_moe` (moe.py) with FP8 e4m3 expert weights, as `kiln::fp8_linear` is
`kiln::linear` with FP8 weights.

    fused_moe_fp8(x [T, H], router_logits [T, E], w13 [E, 2I, H] e4m3, w13_scale, w2 [E, H, I] e4m3, w2_scale,
                  top_k, renormalise, float32_weights, block_n, block_k, activations, expert_scales [E] = None,
                  gelu = False) -> [T, H]
        w13_scale, w2_scale: [E, N] a scale an expert's output row (block_n = 0), or [E, N / block_n, K / block_k]
                             a scale a block (Qwen's FP8 checkpoints: 128 x 128 blocks)
        activations:         how each matmul's input is rounded to e4m3 first, as the checkpoint says: "group" (a
                             scale a row and block_k columns, a block-scaled layer's) or "token" (a scale a row)
        expert_scales, gelu: as `kiln::fused_moe`'s (Gemma 4's): the routing weights times each chosen expert's scale,
                             GELU's tanh form in place of SiLU

The routing is `kiln::fused_moe`'s; each expert computes what `kiln::fp8_linear` computes for its gate/up and its
down projections: x rounded through e4m3, times the dequantized weights, in float32; act(gate) * up in x's dtype,
rounded through e4m3 in turn before the down projection (what Hugging Face's FP8 experts compute, and DeepSeek's
and vLLM's block-FP8 mixtures). Its GPU form is Triton's (moe_fp8_triton.py: e4m3 x e4m3 grouped matmuls on the
FP8 tensor cores, the scales applied a block of K at a time); `fused_moe_fp8_reference` here, a loop over the
chosen experts, is the CPU's form and the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.backends.kernels.fp8 import fp8_linear_reference
from kiln.backends.kernels.moe_routing import route_reference
from kiln.backends.kernels.ops import define


def fused_moe_fp8_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    block_n: int,
    block_k: int,
    activations: str,
    gelu: bool = False,
) -> torch.Tensor:
    """Expert by expert: each one's FP8 gate/up and down projections (`fp8_linear_reference`), its weighted output
    added into the tokens that chose it (in expert order)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        tokens, slot = torch.where(experts == expert)
        gate_up = fp8_linear_reference(
            x[tokens], w13[expert], w13_scale[expert], None, None, block_n, block_k, activations
        )
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        y = fp8_linear_reference(act * up, w2[expert], w2_scale[expert], None, None, block_n, block_k, activations)
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


def _fused_moe_fp8(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    renormalise: bool,
    float32_weights: bool,
    block_n: int,
    block_k: int,
    activations: str,
    expert_scales: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    weights_dtype = torch.float32 if float32_weights else x.dtype
    scales = (w13_scale, w2, w2_scale)
    if x.is_cuda:
        from kiln.backends.kernels.moe_fp8_triton import fused_moe_fp8  # noqa: PLC0415  (Triton where a GPU is)

        routing = (top_k, renormalise, weights_dtype)
        fp8 = (block_n, block_k, activations)
        return fused_moe_fp8(x, router_logits, w13, *scales, *routing, *fp8, None, expert_scales, gelu)
    weights, experts = route_reference(router_logits, top_k, renormalise, weights_dtype)
    if expert_scales is not None:
        weights = weights * expert_scales[experts]
    return fused_moe_fp8_reference(x, w13, *scales, weights, experts, block_n, block_k, activations, gelu)


define(
    "fused_moe_fp8(Tensor x, Tensor router_logits, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, "
    "int top_k, bool renormalise, bool float32_weights, int block_n, int block_k, str activations, "
    "Tensor? expert_scales=None, bool gelu=False) -> Tensor",
    _fused_moe_fp8,
    lambda x, *args: x.new_empty(x.shape),
)
