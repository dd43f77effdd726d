"""Gemma 4 (text): the language model of Gemma4ForCausalLM and Gemma4ForConditionalGeneration (31B, 26B-A4B, E2B,
E4B).

Sliding and full layers as Gemma 3's, with layers of kinds no other Kiln model has:

    sliding layer:  heads of head_dim, num_kv_heads of them, RoPE over the whole head (base 10k)
    full layer:     heads of global_head_dim over num_global_kv_heads; with attention_k_eq_v no v_proj (the value is
                    the key's projection); proportional RoPE (a quarter of the frequency pairs turn, base 1M)
    every layer:    q, k normed (weighted), v normed (unweighted), attention scaled by 1.0; four norms about the
                    attention and the MLP; the layer's output times its `layer_scalar`
    shared layers:  the last num_kv_shared_layers compute q only and attend over the KV cache of the last earlier
                    layer of their kind (`ModelConfig.kv_source_of`), holding none of their own; their MLP may be twice
                    as wide
    per-layer embeddings (E2B, E4B): a second embedding of every token, a slice for each layer, mixed with a projection
                    of the token's embedding; each layer adds gate(h) * its slice, projected back and normed
    MoE (26B-A4B):  beside the dense MLP of every layer, experts (GELU-tanh) routed from the MLP's input, the two
                    outputs normed apart and summed; with `--quantization fp8` the experts in e4m3 too, a scale a row

Every norm scales by its weight as the checkpoint has it (no 1 +). `forward(input_ids[T], positions[T]) ->
hidden[T, H]`, as the Llama family's (llama.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kiln.backends.kernels.moe  # noqa: F401  (registers torch.ops.kiln.fused_moe)
import kiln.backends.kernels.moe_fp8  # noqa: F401  (registers torch.ops.kiln.fused_moe_fp8)
from kiln.backends.attention.op import attend
from kiln.backends.kernels import moe_fp8_triton, moe_triton
from kiln.engine.models import quantization
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import FusedKernelsMixin, Linear, RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, linear
from kiln.engine.models.llama import LlamaForCausalLM
from kiln.engine.models.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardId,
    TensorParallelShard,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)

KVStore = dict[int, tuple[torch.Tensor, torch.Tensor]]  # a shared KV cache's (k, v) of this step, by its kv index


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dim, in float32 (the value norm's, and the router's)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4QKVProjection(ColumnParallelLinear):
    """q, and for a layer with a KV cache of its own k and (without attention_k_eq_v) v, in one matmul: this rank's
    heads, a replicated KV head where there are fewer than ranks."""

    def __init__(self, config: ModelConfig, layer: int, shard: TensorParallelShard, kv_parts: tuple[str, ...]) -> None:
        dim, kv_heads = config.head_dim_of(layer), config.kv_heads_of(layer)
        self.num_heads = shard.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(kv_heads, shard.size)
        # NOTE: a replicated KV head serves the query heads of tp_size / kv_heads consecutive ranks.
        first_kv_head = shard.rank * self.num_kv_heads * kv_heads // max(kv_heads, shard.size)
        q, kv = self.num_heads * dim, self.num_kv_heads * dim
        parts = {"q": (config.num_heads * dim, shard.rank * q, q)}
        for name in kv_parts:
            parts[name] = (kv_heads * dim, first_kv_head * dim, kv)
        super().__init__(config.hidden_size, parts, config.qkv_bias)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kv_index: int, stores_kv: bool, shard: TensorParallelShard):
        """`kv_index`: the KV cache the layer attends over among the attention layers' (its own, or for a shared layer
        its source's); `stores_kv`: whether a shared layer reads this layer's k and v of the step."""
        super().__init__()
        self.head_dim = config.head_dim_of(layer)
        self.kv_index, self.stores_kv = kv_index, stores_kv
        self.shared = config.kv_source_of(layer) != layer
        self.k_eq_v = config.attention_k_eq_v and layer not in config.sliding_layers
        kv_parts = () if self.shared else ("k",) if self.k_eq_v else ("k", "v")
        self.qkv_proj = Gemma4QKVProjection(config, layer, shard, kv_parts)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.window = config.window_of(layer)  # (the runner hands it to the attention backend, by kv index)
        self.eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if not self.shared:
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, config.qkv_bias, shard)

    def forward(self, rotary: RotaryEmbedding, rope: Any, x: torch.Tensor, kv_store: KVStore) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        q = rotary.rotate(rope, self.q_norm(q))
        if self.shared:
            k, v = kv_store[self.kv_index]
        else:
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].view(k.shape)
            k, v = rotary.rotate(rope, self.k_norm(k)), unit_rms_norm(v, self.eps)
            if self.stores_kv:
                kv_store[self.kv_index] = (k, v)
        # NOTE: a shared layer writes its source's k and v of the step again, into the same slots: the op's contract
        # (write, then attend) holds, and the cache is unchanged
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if torch.compiler.is_compiling():  # the op: opaque to Dynamo, where the graph is split
            torch.ops.kiln.unified_attention(q, k, v, out, self.kv_index, 1.0)
        else:
            attend(q, k, v, out, self.kv_index, 1.0)
        return self.o_proj(out.view(num_tokens, self.q_size))


class Gemma4MLP(nn.Module):
    """GeGLU of `intermediate_size` columns (this rank's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], shard)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kv_index: int, stores_kv: bool, shard: TensorParallelShard):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.local_rope = layer in config.sliding_layers
        self.self_attn = Gemma4Attention(config, layer, kv_index, stores_kv, shard)
        wide = config.double_wide_mlp and self.self_attn.shared
        self.mlp = Gemma4MLP(hidden, config.intermediate_size * (2 if wide else 1), shard)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        if config.per_layer_input_size:
            # (small: replicated on every rank)
            self.per_layer_input_gate = Linear(hidden, config.per_layer_input_size, bias=False)
            self.per_layer_projection = Linear(config.per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        rotary: RotaryEmbedding,
        rope: Any,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        kv_store: KVStore,
    ) -> torch.Tensor:
        attn = self.self_attn(rotary, rope, self.input_layernorm(hidden), kv_store)
        hidden = hidden + self.post_attention_layernorm(attn)
        hidden = hidden + self.post_feedforward_layernorm(self._feedforward(hidden))
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar

    def _feedforward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.pre_feedforward_layernorm(hidden))


class Gemma4Router(nn.Module):
    """The experts' router: logits of the unweighted-normed input times `scale` and hidden_size ** -0.5; its top-k
    weights (softmax, renormalised) times each chosen expert's `per_expert_scale`."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.proj = Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.input_scale = hidden_size**-0.5

    def forward(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return linear(unit_rms_norm(x, eps) * self.scale * self.input_scale, self.proj.weight)


class Gemma4Experts(nn.Module):
    """Every expert's gate/up (`gate_up_proj` [E, 2I, H], gate's rows then up's) and down (`down_proj` [E, H, I])
    projections, stacked as the checkpoints ship them; this rank's intermediate columns of each. With `--quantization
    fp8` they hold e4m3 values, quantized as they load, and a scale a row beside them (quantization.py)."""

    weight_names = ("gate_up_proj", "down_proj")  # (the checkpoints' names; FP8 scales beside them: quantization.py)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: TensorParallelShard):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate = intermediate_size
        self.intermediate = shard.split(intermediate_size, "moe_intermediate_size")
        self.start = shard.rank * self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate))

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        if param_name.endswith("_scale"):
            return []  # (made as the weights are quantized at load: an FP8 checkpoint's Gemma 4 experts are refused)
        num_experts, hidden, full = self.num_experts, self.hidden_size, self.full_intermediate
        return [
            (None, (num_experts, 2 * full, hidden) if param_name == "gate_up_proj" else (num_experts, hidden, full))
        ]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        size, start, full = self.intermediate, self.start, self.full_intermediate
        if param_name == "gate_up_proj":
            self._store(param_name, slice(None, size), source[:, start : start + size])
            self._store(param_name, slice(size, None), source[:, full + start : full + start + size])
        else:
            self._store(param_name, slice(None), source[:, :, start : start + size])

    def _store(self, param_name: str, rows: slice, source: torch.Tensor) -> None:
        """Every expert's `rows` of `param_name` from `source` [E, rows, columns]: copied, or with `--quantization fp8`
        quantized a scale a row, an expert at a time."""
        weight = getattr(self, param_name)
        if not quantization.quantized_at_load(self):
            weight[:, rows].copy_(source)
            return
        scale = getattr(self, f"{param_name}_scale")
        for expert in range(self.num_experts):
            quantization.quantize_into(weight[expert, rows], scale[expert, rows], source[expert])


class Gemma4MoeDecoderLayer(FusedKernelsMixin, Gemma4DecoderLayer):
    """A layer whose feed-forward is the dense MLP and the experts side by side (26B-A4B). Eager on the GPU (`fused`)
    the experts are the Triton kernels called directly; otherwise the `kiln::fused_moe` op (FP8 experts:
    `kiln::fused_moe_fp8`, with the same GELU-tanh and scales a chosen expert)."""

    def __init__(self, config: ModelConfig, layer: int, kv_index: int, stores_kv: bool, shard: TensorParallelShard):
        super().__init__(config, layer, kv_index, stores_kv, shard)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.router = Gemma4Router(hidden, config.num_experts)
        self.experts = Gemma4Experts(config.num_experts, hidden, config.moe_intermediate_size, shard)
        for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(hidden, eps))
        self.top_k, self.eps, self.tp_size = config.num_experts_per_tok, eps, shard.size

    def _feedforward(self, hidden: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(hidden)))
        logits = self.router(hidden, self.eps)  # (the experts are routed from the MLP's input, as it enters)
        x = self.pre_feedforward_layernorm_2(hidden)
        experts, scales = self.experts, self.router.per_expert_scale
        routing = (self.top_k, True)  # (renormalised; the weights in float32, as the reference keeps them)
        if quantization.is_fp8(experts):
            weights = (experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj, experts.down_proj_scale)
            fp8 = (*quantization.expert_block(experts), experts.quant.activations)
            if self.fused:
                args = (x, logits, *weights, *routing, torch.float32, *fp8)
                out = moe_fp8_triton.fused_moe_fp8(*args, expert_scales=scales, gelu=True)
            else:
                out = torch.ops.kiln.fused_moe_fp8(x, logits, *weights, *routing, True, *fp8, scales, True)
        else:
            weights = (experts.gate_up_proj, experts.down_proj)
            if self.fused:
                out = moe_triton.fused_moe(
                    x, logits, *weights, *routing, torch.float32, expert_scales=scales, gelu=True
                )
            else:
                out = torch.ops.kiln.fused_moe(x, logits, *weights, *routing, True, scales, True)
        if self.tp_size > 1:
            torch.ops.kiln.all_reduce_(out)
        return dense + self.post_feedforward_layernorm_2(out)


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.embed_scale = config.embed_scale
        if config.per_layer_input_size:
            # (the table is split by vocabulary rows across ranks, as the embedding is; the projection is replicated)
            self.num_layers, self.per_layer_size = config.num_layers, config.per_layer_input_size
            width = config.num_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.per_layer_vocab_size, width, shard)
            self.per_layer_model_projection = Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(config.per_layer_input_size, config.rms_norm_eps)
        # the sliding layers' RoPE over head_dim, the full layers' (proportional) over theirs
        self.local_rotary_emb = RotaryEmbedding(
            config.head_dim, max_positions, config.local_rope_theta or 10000.0, config.local_rope_scaling
        )
        full_dim = config.global_head_dim or config.head_dim
        self.rotary_emb = RotaryEmbedding(full_dim, max_positions, config.rope_theta, config.rope_scaling)
        # NOTE: the shared layers are the last ones, so a layer with a KV cache of its own has the kv index of its layer
        # index, and the runner's windows (read from model.layers by kv index) are theirs.
        kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        sources = {
            config.kv_source_of(layer)
            for layer in range(config.num_layers - config.num_kv_shared_layers, config.num_layers)
        }
        layer_class = Gemma4MoeDecoderLayer if config.moe_layers else Gemma4DecoderLayer
        self.layers = nn.ModuleList(
            layer_class(config, layer, kv_index[config.kv_source_of(layer)], layer in sources, shard)
            for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        per_layer = self._per_layer_inputs(input_ids, hidden) if hasattr(self, "embed_tokens_per_layer") else None
        local = self.local_rotary_emb.lookup(positions, hidden.dtype)
        rope = self.rotary_emb.lookup(positions, hidden.dtype)
        kv_store: KVStore = {}
        for i, layer in enumerate(self.layers):
            rotary, lookup = (self.local_rotary_emb, local) if layer.local_rope else (self.rotary_emb, rope)
            layer_input = per_layer[:, i] if per_layer is not None else None
            hidden = layer(rotary, lookup, hidden, layer_input, kv_store)
        return self.norm(hidden)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """E2B's and E4B's per-layer inputs [T, L, P]: the token's row of a second table (every layer's slice side by
        side, times sqrt(P)) and a projection of its embedding (times hidden_size ** -0.5, normed per layer), summed
        and scaled by 2 ** -0.5."""
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = tokens * torch.tensor(self.per_layer_size**0.5, dtype=tokens.dtype, device=tokens.device)
        projected = self.per_layer_model_projection(embeddings) * embeddings.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.view(-1, self.num_layers, self.per_layer_size))
        return (projected + tokens.view(-1, self.num_layers, self.per_layer_size)) * 2**-0.5


class Gemma4ForCausalLM(LlamaForCausalLM):
    """The Llama family's wrapper (embedding, LM head and their tie, the final soft-cap) around Gemma 4's model."""

    model_class = Gemma4Model

    def __init__(
        self, config: ModelConfig, max_positions: int | None = None, shard: TensorParallelShard | None = None
    ) -> None:
        super().__init__(config, max_positions, shard)
        first_shared = config.num_layers - config.num_kv_shared_layers
        self._unused = tuple(
            f"model.layers.{layer}.self_attn.{part}."
            for layer in range(first_shared, config.num_layers)
            for part in ("k_proj", "v_proj", "k_norm", "v_norm")
        )

    def unused_checkpoint_tensor(self, name: str) -> bool:
        """The checkpoints keep k and v projections and norms for the shared layers, which never compute them."""
        return name.startswith(self._unused)
