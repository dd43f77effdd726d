"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router picks each token's top-k experts, and the
`kiln::fused_moe` op runs only those (backends/kernels/moe.py).

    router:  logits = x @ gate^T [T, E], softmax in float32, top-k, optionally renormalised
    experts: sum over the k chosen e of  weight_e * down_e(silu(gate_e(x)) * up_e(x))
    shared:  Qwen2-MoE adds sigmoid(x @ shared_gate^T) * shared_mlp(x), an MLP every token takes

The checkpoints ship one tensor per expert and projection; the loader stacks them into one tensor a layer (w13:
[E, 2I, H], gate's rows then up's; w2: [E, H, I]), which is what a grouped kernel reads. FP8 experts (an FP8
checkpoint's, or `--quantization fp8`'s: quantization.py) hold them in e4m3 with their scales beside them
(`w13_scale`, `w2_scale`) and run the `kiln::fused_moe_fp8` op. With tensor parallelism every rank holds every expert,
cut along the intermediate dimension as the dense MLP is, and one all-reduce adds the ranks' partial sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kiln.backends.kernels.moe  # noqa: F401  (registers torch.ops.kiln.fused_moe)
import kiln.backends.kernels.moe_fp8  # noqa: F401  (registers torch.ops.kiln.fused_moe_fp8)
from kiln.backends.kernels import moe_fp8_triton, moe_triton
from kiln.engine.models import quantization
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import FusedKernelsMixin, Linear, RMSNorm, linear, project_silu_mul
from kiln.engine.models.parallel import MergedColumnParallelLinear, RowParallelLinear, ShardId, TensorParallelShard


class Experts(nn.Module):
    """Every expert's gate/up (`w13`) and down (`w2`) projections, this rank's intermediate columns of each."""

    weight_names = ("w13", "w2")  # (FP8 experts' scales beside them: quantization.py)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate = intermediate_size
        self.intermediate = shard.split(intermediate_size, "moe_intermediate_size")
        self.start = shard.rank * self.intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate))

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        """One checkpoint tensor per expert and projection: (expert, 0) gate, (expert, 1) up, (expert, None) down (and
        FP8 experts' scales of each)."""
        if param_name in ("w13_scale", "w2_scale"):
            return quantization.expert_scale_parts(self, param_name)
        if param_name == "w13":
            shape = (self.full_intermediate, self.hidden_size)
            return [((e, part), shape) for e in range(self.num_experts) for part in (0, 1)]
        return [((e, None), (self.hidden_size, self.full_intermediate)) for e in range(self.num_experts)]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        if param_name in ("w13_scale", "w2_scale"):
            quantization.load_expert_scale(self, param_name, source, shard)
            return
        expert, part = shard
        size, start = self.intermediate, self.start
        if param_name == "w13":
            rows, source = slice(part * size, (part + 1) * size), source[start : start + size]
        else:
            rows, source = slice(None), source[:, start : start + size]
        if quantization.quantized_at_load(self):  # `--quantization fp8`: a scale a row
            scale = getattr(self, f"{param_name}_scale")[expert, rows]
            quantization.quantize_into(getattr(self, param_name)[expert, rows], scale, source)
        else:
            getattr(self, param_name)[expert, rows].copy_(source)


class SparseMoeBlock(FusedKernelsMixin, nn.Module):
    """The MLP of a sparse layer: `forward(norm, hidden, residual)` as the dense MLP's. Eager on the GPU (`fused`)
    it calls the Triton kernels directly; otherwise the op (traced: opaque to Dynamo; on the CPU the plain form)."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        # Mixtral keeps the routing weights in float32 into the experts; the Qwen models cast them to the model's dtype
        self.float32_weights = config.architecture == "MixtralForCausalLM"
        self.tp_size = shard.size
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router, whole on every rank
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, shard)
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size, config.shared_expert_intermediate_size, shard)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm(hidden, residual)
        logits = linear(x, self.gate.weight)
        weights_dtype = torch.float32 if self.float32_weights else x.dtype
        experts, routing = self.experts, (self.top_k, self.renormalise)
        if quantization.is_fp8(experts):
            args = (x, logits, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale, *routing)
            fp8 = (*quantization.expert_block(experts), experts.quant.activations)
            if self.fused:
                out = moe_fp8_triton.fused_moe_fp8(*args, weights_dtype, *fp8)
            else:
                out = torch.ops.kiln.fused_moe_fp8(*args, self.float32_weights, *fp8)
        elif self.fused:
            out = moe_triton.fused_moe(x, logits, experts.w13, experts.w2, *routing, weights_dtype)
        else:
            out = torch.ops.kiln.fused_moe(x, logits, experts.w13, experts.w2, *routing, self.float32_weights)
        if self.tp_size > 1:
            torch.ops.kiln.all_reduce_(out)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out, residual


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SiLU MLP (its down projection all-reduced on its own)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], shard)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(project_silu_mul(x, self.gate_up_proj))
