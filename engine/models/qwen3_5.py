"""Qwen3.5 / Qwen3.6 and Qwen3-Next: the Gated DeltaNet hybrid, dense or with a sparse MoE (and a gated shared expert).

Three of every four layers are linear attention (Gated DeltaNet): no KV cache, but a fixed-size recurrent state per
request (a causal conv's last inputs and a delta-rule matrix per value head), which the `kiln::gated_delta_net` op
reads and updates in the state slot the scheduler gave the request (kiln.cache.state_cache). Every fourth layer is
full attention with q/k norms, RoPE over the first quarter of each head, and a sigmoid output gate that q_proj yields
beside each head. Every norm scales by 1 + its weight (the loader adds the 1), except the gated norm inside the linear
layers.

    linear layer:  x ─► in_proj_qkvz ─► [q k v | z]   in_proj_ba ─► [b | a]
                   q k v ─► conv1d + SiLU ─► delta rule (beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias))
                   ─► gated RMSNorm(·, z) ─► out_proj

`forward(input_ids[T], positions[T]) -> hidden[T, H]`, as the Llama family's (llama.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.backends.attention.op import attend
from kiln.backends.linear_attention import gated_delta_net, torch_forms
from kiln.engine.models import quantization
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import FusedKernelsMixin, RMSNorm, rms_norm, rope_inv_freq
from kiln.engine.models.llama import MLP, LlamaForCausalLM
from kiln.engine.models.moe import SparseMoeBlock
from kiln.engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardId,
    TensorParallelShard,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)


def _add_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(hidden + residual) and the new residual (the first layer's: hidden itself)."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def _rank_rows(full: int, shard: TensorParallelShard, what: str) -> tuple[int, int, int]:
    """(rows of the full tensor, the first this rank reads, how many): an even split of `full` rows."""
    size = shard.split(full, what)
    return full, shard.rank * size, size


class QKVZProjection(ColumnParallelLinear):
    """A linear layer's q, k, v and z in one matmul, this rank's key and value heads: rows [q | k | v | z].

    Qwen3.5 ships [q | k | v] (`in_proj_qkv`) and z (`in_proj_z`); Qwen3-Next one tensor grouped by key head, each
    group [q k v z] of that head and its values' heads (`in_proj_qkvz`). An FP8 checkpoint's scales come in the same
    layout (a block's scale where its weights are): each part takes its own, as the parts of a fused layer do."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard, grouped: bool) -> None:
        heads_k, heads_v = config.linear_num_key_heads, config.linear_num_value_heads
        key_dim, value_dim = heads_k * config.linear_key_head_dim, heads_v * config.linear_value_head_dim
        parts = {
            "q": _rank_rows(key_dim, shard, "linear_num_key_heads x dim"),
            "k": _rank_rows(key_dim, shard, "linear_num_key_heads x dim"),
            "v": _rank_rows(value_dim, shard, "linear_num_value_heads x dim"),
            "z": _rank_rows(value_dim, shard, "linear_num_value_heads x dim"),
        }
        super().__init__(config.hidden_size, parts, bias=False)
        self.grouped, self.heads_k = grouped, heads_k
        self.dims = (config.linear_key_head_dim, config.linear_value_head_dim * heads_v // heads_k)

    def hf_modules(self, name: str) -> tuple[str, ...]:
        """The Hugging Face modules this layer (`name`) holds, as a checkpoint's ignore list names them."""
        head = name.rpartition(".")[0]
        return (name,) if self.grouped else (f"{head}.in_proj_qkv", f"{head}.in_proj_z")

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        rows = {name: full for name, (full, _, _) in self.parts.items()}
        if self.grouped:
            tensors = [(None, sum(rows.values()))]
        else:
            tensors = [("qkv", rows["q"] + rows["k"] + rows["v"]), ("z", rows["z"])]
        if param_name in ("weight_scale", "input_scale"):  # an FP8 layer's
            return quantization.scale_parts(self, param_name, tensors)
        return [(shard, (n, self.in_features)) for shard, n in tensors]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        """Each part the checkpoint tensor holds, loaded as a fused layer loads its parts (this rank's rows; an FP8
        layer's scales, or its weights quantized at load)."""
        whole = source[...]
        unit = quantization.rows_of(self, param_name)
        if unit is None:  # one value for the whole tensor (a scale a tensor, a static input scale): each part's
            pieces = dict.fromkeys("qkvz" if self.grouped else "qkv" if shard == "qkv" else "z", whole)
        elif self.grouped:  # [Hk, (q, k, v, z) of the head] -> each part whole
            key_dim, values_dim = (_whole_units(d, unit, "linear head dims") for d in self.dims)
            groups = whole.reshape(self.heads_k, 2 * key_dim + 2 * values_dim, -1)
            split = groups.split([key_dim, key_dim, values_dim, values_dim], dim=1)
            pieces = {name: p.reshape(-1, whole.shape[-1]) for name, p in zip("qkvz", split)}
        elif shard == "qkv":
            sizes = [_whole_units(self.parts[n][0], unit, f"in_proj_qkv's {n}") for n in "qkv"]
            pieces = dict(zip("qkv", whole.split(sizes)))
        else:
            pieces = {"z": whole}
        for name, piece in pieces.items():
            super().load_weight(param_name, piece, name)


class BAProjection(ColumnParallelLinear):
    """A linear layer's b (beta's logits) and a (the decay's), a row per value head, this rank's: [b | a]. Qwen3.5
    ships `in_proj_b` and `in_proj_a`; Qwen3-Next `in_proj_ba`, grouped by key head (its values' b, then their a)."""

    # NOTE: `--quantization fp8` leaves it in 16 bits, as Qwen's FP8 checkpoints leave in_proj_a and in_proj_b (and
    # Qwen3-Next's in_proj_ba): a row a head, each the gate of its decay or of its write strength
    quantize_online = False

    def __init__(self, config: ModelConfig, shard: TensorParallelShard, grouped: bool) -> None:
        heads_v = config.linear_num_value_heads
        parts = {name: _rank_rows(heads_v, shard, "linear_num_value_heads") for name in ("b", "a")}
        super().__init__(config.hidden_size, parts, bias=False)
        self.grouped, self.heads_k = grouped, config.linear_num_key_heads

    def hf_modules(self, name: str) -> tuple[str, ...]:
        """The Hugging Face modules this layer (`name`) holds, as a checkpoint's ignore list names them."""
        head = name.rpartition(".")[0]
        return (name,) if self.grouped else (f"{head}.in_proj_b", f"{head}.in_proj_a")

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        heads_v = self.parts["b"][0]
        tensors = [(None, 2 * heads_v)] if self.grouped else [("b", heads_v), ("a", heads_v)]
        if param_name in ("weight_scale", "input_scale"):  # an FP8 layer's
            return quantization.scale_parts(self, param_name, tensors)
        return [(shard, (n, self.in_features)) for shard, n in tensors]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        whole = source[...]
        unit = quantization.rows_of(self, param_name)
        if not self.grouped:
            pieces = {shard: whole}
        elif unit is None:
            pieces = dict.fromkeys("ba", whole)
        else:
            per_head = _whole_units(self.parts["b"][0] // self.heads_k, unit, "in_proj_ba's values a key head")
            b, a = whole.reshape(self.heads_k, 2, per_head, whole.shape[-1]).unbind(1)
            pieces = {"b": b.reshape(-1, whole.shape[-1]), "a": a.reshape(-1, whole.shape[-1])}
        for name, piece in pieces.items():
            super().load_weight(param_name, piece, name)


def _whole_units(rows: int, unit: int, what: str) -> int:
    """Rows of a checkpoint tensor that `rows` weight rows take (`unit` to one: a block's rows for its scales)."""
    if rows % unit:
        raise quantization.refuse(f"{what} of {rows} rows, not whole {unit}-row blocks of FP8 scales")
    return rows // unit


class CausalConv1d(nn.Module):
    """The depthwise conv's taps [channels, K], this rank's q, k and v channels (the checkpoint's [D, 1, K])."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        self.parts = [_rank_rows(n, shard, "linear heads") for n in (key_dim, key_dim, value_dim)]
        self.kernel_size = config.linear_conv_kernel_dim
        self.weight = nn.Parameter(torch.empty(sum(size for _, _, size in self.parts), self.kernel_size))

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        return [(None, (sum(full for full, _, _ in self.parts), 1, self.kernel_size))]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        whole = source[:].reshape(-1, self.kernel_size)
        offset = first = 0
        for full, start, size in self.parts:
            self.weight[offset : offset + size].copy_(whole[first + start : first + start + size])
            offset, first = offset + size, first + full


class GatedRMSNorm(FusedKernelsMixin, nn.Module):
    """weight * rmsnorm(x) * silu(z) over each value head (its weight as the checkpoint has it: no 1 added)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from kiln.backends.linear_attention import triton_norm  # noqa: PLC0415

            return triton_norm.gated_rms_norm(x, z, self.weight, self.eps)
        return torch_forms.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """This rank's linear-attention heads (value heads and the key heads they read split alike)."""

    def __init__(self, config: ModelConfig, state_index: int, shard: TensorParallelShard) -> None:
        super().__init__()
        grouped = config.architecture == "Qwen3NextForCausalLM"
        self.state_index = state_index  # the layer's state tensors in the forward context
        self.num_value_heads = shard.split(config.linear_num_value_heads, "linear_num_value_heads")
        self.full_value_heads, self.start = config.linear_num_value_heads, shard.rank * self.num_value_heads
        self.head_v_dim = config.linear_value_head_dim
        self.in_proj_qkvz = QKVZProjection(config, shard, grouped)
        self.in_proj_ba = BAProjection(config, shard, grouped)
        self.conv1d = CausalConv1d(config, shard)
        self.conv_dim = self.conv1d.weight.shape[0]
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        value_dim = config.linear_num_value_heads * self.head_v_dim
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, False, shard)

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        return [(None, (self.full_value_heads,))]  # dt_bias, A_log: a value a head

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        getattr(self, param_name).copy_(source[self.start : self.start + self.num_value_heads])

    def forward(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        x, residual = _add_norm(norm, hidden, residual)
        num_tokens = x.shape[0]
        qkvz = self.in_proj_qkvz(x)
        mixed_qkv, z = qkvz[:, : self.conv_dim], qkvz[:, self.conv_dim :]
        b, a = self.in_proj_ba(x).split(self.num_value_heads, dim=1)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # the log of each token's decay
        core = torch.empty(num_tokens, self.num_value_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        if torch.compiler.is_compiling():  # the op: opaque to Dynamo, where the graph is split
            torch.ops.kiln.gated_delta_net(mixed_qkv, g, beta, self.conv1d.weight, core, self.state_index)
        else:
            gated_delta_net(mixed_qkv, g, beta, self.conv1d.weight, core, self.state_index)
        out = self.norm(core.view(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.view(num_tokens, -1)), residual


class GatedQKVProjection(ColumnParallelLinear):
    """q (each head followed by its output gate: 2 x head_dim rows a head), k and v in one matmul, this rank's heads."""

    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        dim, kv_heads = config.head_dim, config.num_kv_heads
        self.num_heads = shard.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(kv_heads, shard.size)
        first_kv_head = shard.rank * self.num_kv_heads * kv_heads // max(kv_heads, shard.size)
        q, kv = 2 * self.num_heads * dim, self.num_kv_heads * dim
        parts = {"q": (2 * config.num_heads * dim, shard.rank * q, q)}
        for name in ("k", "v"):
            parts[name] = (kv_heads * dim, first_kv_head * dim, kv)
        super().__init__(config.hidden_size, parts, config.qkv_bias)


class GatedAttention(nn.Module):
    """Full attention with q/k norms, RoPE over the first `rotary_dim` dims, and a sigmoid gate on each head's
    output."""

    def __init__(self, config: ModelConfig, kv_index: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.kv_index = kv_index  # the layer's KV cache among the attention layers'
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim or config.head_dim
        self.qkv_proj = GatedQKVProjection(config, shard)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, False, shard)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        norm: RMSNorm,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = _add_norm(norm, hidden, residual)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, : 2 * self.q_size].view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate.split(self.head_dim, dim=-1)
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, -1)
        v = qkv[:, 2 * self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        q = self._rotate(rope, rms_norm(q, self.q_norm.weight, self.q_norm.eps))
        k = self._rotate(rope, rms_norm(k, self.k_norm.weight, self.k_norm.eps))
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if torch.compiler.is_compiling():
            torch.ops.kiln.unified_attention(q, k, v, out, self.kv_index, self.scale)
        else:
            attend(q, k, v, out, self.kv_index, self.scale)
        out = out.view(num_tokens, self.q_size) * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        return self.o_proj(out), residual

    def _rotate(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Neox-style RoPE over the first `rotary_dim` dims of each head; the rest pass as they are."""
        cos, sin = (t.unsqueeze(1) for t in rope)
        rotated, passed = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rotated.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed], dim=-1)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, index: int, shard: TensorParallelShard) -> None:
        """`index`: the layer's place among the layers of its kind (its state, or its KV cache)."""
        super().__init__()
        if layer in config.linear_layers:
            self.linear_attn = GatedDeltaNet(config, index, shard)
        else:
            self.self_attn = GatedAttention(config, index, shard)
        self.mlp = SparseMoeBlock(config, shard) if layer in config.moe_layers else MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(self, "linear_attn"):
            hidden, residual = self.linear_attn(self.input_layernorm, hidden, residual)
        else:
            hidden, residual = self.self_attn(rope, self.input_layernorm, hidden, residual)
        return self.mlp(self.post_attention_layernorm, hidden, residual)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        rotary_dim = config.rotary_dim or config.head_dim
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rotary_dim, config.rope_theta, None)
        )
        # NOTE: float32 and not a parameter: the loader never touches it, and `model.to(dtype)` keeps it.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        linear = set(config.linear_layers)
        index_of = {layer: i for i, layer in enumerate(config.linear_layers)}
        index_of |= {layer: i for i, layer in enumerate(config.attention_layers)}
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, layer, index_of[layer], shard) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.num_linear = len(linear)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.cos_sin[positions].to(hidden.dtype).chunk(2, dim=-1)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """The Llama family's wrapper (embedding, LM head, their tie) around the hybrid model."""

    model_class = HybridModel
    # Hugging Face projection name -> (Kiln fused parameter, shard id): the Llama family's and the linear layers'
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"),
        "in_proj_a": ("in_proj_ba", "a"),
    }
