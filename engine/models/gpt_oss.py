"""gpt-oss (gpt-oss-20b, gpt-oss-120b): OpenAI's open-weight mixture of experts.

    every layer:  ─► RMSNorm ─► attention: QKV and output biases, YaRN RoPE, a learned sink a head, every other layer
                     a 128-token sliding window ─► + ─► RMSNorm ─► router (biased; the top k logits, their softmax)
                  ─► k experts (biased; clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit))
                  ─► +

A sink is a logit that joins its head's softmax denominator in every row and attends to nothing: the attention op
takes it as an argument (it is a weight, not step metadata). The experts are 16-bit, or MXFP4 as OpenAI publishes
them and kept so on the device (`*_blocks`: two e2m1 values a byte, `*_scales`: an e8m0 a 32 values;
kiln.backends.kernels.mxfp4): `kiln::gpt_oss_moe` reads either, its Triton form dequantizing in registers.

Checkpoints name the experts as one tensor a layer and projection, the gate's and up projection's outputs interleaved
(gate 2i, up 2i + 1); the bf16 ones others publish transposed ([E, H, 2I], [E, I, H]), the MXFP4 ones by output row
([E, 2I, H/32, 16]). Kiln keeps each expert [gate rows | up rows] x H and H x I, this rank's intermediate columns.

`forward(input_ids[T], positions[T]) -> hidden[T, H]`, as the Llama family's (llama.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.backends.attention.op import attend
from kiln.backends.kernels import mxfp4
from kiln.backends.kernels.gpt_oss_moe import Experts  # (the module registers torch.ops.kiln.gpt_oss_moe)
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import FusedKernelsMixin, Linear, RMSNorm, RotaryEmbedding, linear
from kiln.engine.models.llama import Attention, LlamaForCausalLM, save_aux_states
from kiln.engine.models.parallel import ShardId, TensorParallelShard, VocabParallelEmbedding


class GptOssAttention(Attention):
    """The Llama family's attention (QKV and output biases from the config) with this rank's heads' sinks."""

    def __init__(
        self, config: ModelConfig, layer_index: int, rotary_emb: RotaryEmbedding, shard: TensorParallelShard
    ) -> None:
        super().__init__(config, layer_index, rotary_emb, shard)
        self.full_heads, self.first_head = config.num_heads, shard.rank * self.num_heads
        # float32 whatever the model's dtype: the kernels add it to float32 scores
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        return [(None, (self.full_heads,))]  # (its one parameter of its own: the sinks)

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        self.sinks.copy_(source[self.first_head : self.first_head + self.num_heads])

    def _attend(self, qkv: torch.Tensor, qk: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the projection's q, k (rotated: `qk` [T, Hq + Hk, D], else qkv's own) and v, with the sinks;
        then o."""
        num_tokens = qkv.shape[0]
        if qk is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        if torch.compiler.is_compiling():  # the op: opaque to Dynamo, where the graph is split
            torch.ops.kiln.unified_attention(q, k, v, out, self.layer_index, self.scale, self.sinks)
        else:
            attend(q, k, v, out, self.layer_index, self.scale, self.sinks)
        return self.o_proj(out.view(num_tokens, self.q_size))


def intermediate_share(size: int, shard: TensorParallelShard, granule: int) -> tuple[int, int]:
    """(first column, columns) of this rank's share of an intermediate dimension of `size`, split in whole runs of
    `granule` columns as evenly as they go (MXFP4: 32, a scale's block; the first ranks take one run more where they do
    not divide evenly, as 2880 columns over 4 or 8 ranks do not)."""
    if size % granule:
        raise ValueError(f"the experts' intermediate size {size} is not whole blocks of {granule} (MXFP4)")
    runs = size // granule
    if runs < shard.size:
        raise ValueError(f"the experts' intermediate size {size} cannot be cut in {shard.size} ranks' shares")
    per_rank, extra = divmod(runs, shard.size)
    first = shard.rank * per_rank + min(shard.rank, extra)
    return first * granule, (per_rank + (shard.rank < extra)) * granule


class GptOssExperts(nn.Module):
    """Every expert's projections, this rank's intermediate columns, under the checkpoint's names: 16-bit
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], or MXFP4 `*_blocks` (uint8 [E, N, K/2]) and `*_scales`
    (uint8 [E, N, K/32]); the biases `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H]. 2I: the gate's rows,
    then the up projection's."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        experts, hidden, full = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.mxfp4 = config.mxfp4_experts
        self.num_experts, self.hidden_size, self.full_intermediate = experts, hidden, full
        self.start, inter = intermediate_share(full, shard, mxfp4.BLOCK if self.mxfp4 else 1)
        self.intermediate = inter
        if self.mxfp4:
            if hidden % mxfp4.BLOCK:
                raise ValueError(f"hidden_size {hidden} is not whole blocks of {mxfp4.BLOCK} (MXFP4)")
            self.gate_up_proj_blocks = _uint8(experts, 2 * inter, hidden // 2)
            self.gate_up_proj_scales = _uint8(experts, 2 * inter, hidden // mxfp4.BLOCK)
            self.down_proj_blocks = _uint8(experts, hidden, inter // 2)
            self.down_proj_scales = _uint8(experts, hidden, inter // mxfp4.BLOCK)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
            self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))

    def weights(self) -> tuple[torch.Tensor, ...]:
        """(w13, w2, w13_scale, w2_scale) as `kiln::gpt_oss_moe` takes them (scales None for 16-bit weights)."""
        if self.mxfp4:
            w13 = self.gate_up_proj_blocks.flatten(2)
            w2 = self.down_proj_blocks.flatten(2)
            return w13, w2, self.gate_up_proj_scales, self.down_proj_scales
        return self.gate_up_proj, self.down_proj, None, None

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        """The checkpoint's whole tensor of each parameter (one a layer and projection)."""
        experts, hidden, inter = self.num_experts, self.hidden_size, self.full_intermediate
        shapes = {
            "gate_up_proj": (experts, hidden, 2 * inter),
            "down_proj": (experts, inter, hidden),
            "gate_up_proj_blocks": (experts, 2 * inter, hidden // mxfp4.BLOCK, mxfp4.BLOCK // 2),
            "gate_up_proj_scales": (experts, 2 * inter, hidden // mxfp4.BLOCK),
            "down_proj_blocks": (experts, hidden, inter // mxfp4.BLOCK, mxfp4.BLOCK // 2),
            "down_proj_scales": (experts, hidden, inter // mxfp4.BLOCK),
            "gate_up_proj_bias": (experts, 2 * inter),
            "down_proj_bias": (experts, hidden),
        }
        return [(None, shapes[param_name])]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        """This rank's columns of each expert, one expert at a time (120b's bf16 gate_up_proj is 4 GB a layer)."""
        param = getattr(self, param_name)
        for expert in range(self.num_experts):
            whole = source[expert : expert + 1][0]
            param[expert].copy_(self._rank_part(param_name, whole))

    def _rank_part(self, param_name: str, whole: torch.Tensor) -> torch.Tensor:
        """One expert's checkpoint tensor as this rank holds it."""
        start, size = self.start, self.intermediate
        if param_name == "gate_up_proj":  # [H, 2I] interleaved -> [gate | up] rows x H
            whole = whole.t()
        if param_name in ("gate_up_proj", "gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
            gate, up = whole[0::2][start : start + size], whole[1::2][start : start + size]
            return torch.cat([gate, up]).flatten(1) if whole.dim() > 2 else torch.cat([gate, up])
        if param_name == "down_proj":  # [I, H] -> H x this rank's I
            return whole[start : start + size].t()
        if param_name in ("down_proj_blocks", "down_proj_scales"):  # [H, I/32(, 16)]: this rank's blocks
            first = start // mxfp4.BLOCK
            return whole[:, first : first + size // mxfp4.BLOCK].flatten(1)
        return whole  # down_proj_bias

    def dummy_source(self, param_name: str, generator: torch.Generator) -> torch.Tensor | None:
        """Random MXFP4 weights of a realistic scale for `--load-format dummy` (every code equally likely, each block
        scaled by 2^-7: a standard deviation of about 0.02); None for the 16-bit ones (the loader draws those)."""
        if not param_name.endswith(("_blocks", "_scales")):
            return None
        shape = self.checkpoint_parts(param_name)[0][1]
        device = getattr(self, param_name).device
        if param_name.endswith("_scales"):
            return torch.full(shape, mxfp4.SCALE_BIAS - 7, dtype=torch.uint8, device=device)
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8, device=device)


def _uint8(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)


class GptOssMoE(FusedKernelsMixin, nn.Module):
    """The MLP of every layer: `forward(norm, hidden, residual)` as the dense MLP's. Eager on the GPU (`fused`) it
    calls the Triton kernels directly; otherwise the op (traced: opaque to Dynamo; on the CPU the plain form)."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit = config.num_experts_per_tok, config.swiglu_alpha, config.swiglu_limit
        self.tp_size, self.adds_down_bias = shard.size, shard.rank == 0  # (one rank adds it, before the all-reduce)
        self.router = Linear(config.hidden_size, config.num_experts, bias=True)  # whole on every rank
        self.experts = GptOssExperts(config, shard)

    def forward(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm(hidden, residual)
        # (the routing inside the op: the top k of the logits, the softmax of those k, as Hugging Face routes)
        logits = linear(x, self.router.weight, self.router.bias)
        w13, w2, w13_scale, w2_scale = self.experts.weights()
        down_bias = self.experts.down_proj_bias if self.adds_down_bias else None
        layer = Experts(w13, self.experts.gate_up_proj_bias, w2, down_bias, self.alpha, self.limit, w13_scale, w2_scale)
        if self.fused:
            from kiln.backends.kernels import gpt_oss_moe_triton  # noqa: PLC0415  (Triton where a GPU is)

            out = gpt_oss_moe_triton.routed_gpt_oss_moe(x, logits, self.top_k, layer)
        else:
            out = torch.ops.kiln.gpt_oss_moe(x, logits, self.top_k, *layer)
        if self.tp_size > 1:
            torch.ops.kiln.all_reduce_(out)
        return out, residual


class GptOssDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, rotary_emb: RotaryEmbedding, shard: TensorParallelShard
    ) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_index, rotary_emb, shard)
        self.mlp = GptOssMoE(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # (each residual add is fused into the next norm, as in llama.py)
        hidden, residual = self.self_attn(rope, self.input_layernorm, hidden, residual)
        return self.mlp(self.post_attention_layernorm, hidden, residual)


class GptOssModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, i, self.rotary_emb, shard) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_layers: tuple[int, ...] = ()  # (EAGLE-3: the layers whose input states its draft reads)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.lookup(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            save_aux_states(self.aux_layers, index, hidden, residual)
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GptOssForCausalLM(LlamaForCausalLM):
    """The Llama family's wrapper (embedding, LM head, their tie) around gpt-oss's model."""

    model_class = GptOssModel
    # Hugging Face projection name -> (Kiln fused parameter, shard id): the experts come whole, no gate/up to join
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
