"""The Llama family over a flat token layout: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm), their
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: a sparse MLP in the layers the config names, moe.py), and Gemma
2 and 3 (GeGLU, scaled embeddings, four norms a layer; Gemma 2's soft-capped scores and logits, Gemma 3's two RoPE
bases).

`forward(input_ids[T], positions[T]) -> hidden[T, H]`: no batch dimension and no padding inside the
model; how tokens group into requests is known only to the attention op, through the forward context.
The differences between the architectures are flags on `ModelConfig`, not subclasses.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.backends.attention.aux_hidden import save_hidden
from kiln.backends.attention.op import attend  # (the module registers torch.ops.kiln.unified_attention)
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, norm_linear, rms_norm
from kiln.engine.models.moe import SparseMoeBlock
from kiln.engine.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelShard,
    VocabParallelEmbedding,
)


class Attention(nn.Module):
    """This rank's attention heads (all of them with one rank)."""

    def __init__(
        self, config: ModelConfig, layer_index: int, rotary_emb: RotaryEmbedding, shard: TensorParallelShard
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        # q, k and v in one matmul; the loader writes each Hugging Face projection into its slice.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias, shard
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.window = config.window_of(layer_index)  # (the forward context hands it to the attention backend)
        self.softcap = config.attn_softcap  # (Gemma 2's, handed over the same way)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, config.o_bias, shard)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if config.quantization is not None and config.quantization.kv_scales:
            # the checkpoint's FP8 KV cache scales: the cache holds k / k_scale and v / v_scale (see `_attend`)
            self.k_scale = nn.Parameter(torch.ones(1), requires_grad=False)  # ([1]: a checkpoint's [] or [1] fits)
            self.v_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer

    def forward(
        self, rope, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over norm(hidden + residual) (see `norm_linear`), then o: (o's output, the new residual).
        `rope`: the rotary's lookup for this step's positions, made once for all layers."""
        num_tokens = hidden.shape[0]
        if hidden.is_cuda and torch.compiler.is_compiling() and not hasattr(self, "q_norm"):
            # the rotary inside the projection's op: at batch 1 the one-row kernel rotates q and k (no launch of
            # its own); beyond it, cuBLAS then the rotary kernel in place
            qkv, residual = norm_linear(
                norm,
                hidden,
                residual,
                self.qkv_proj,
                "rope",
                rope,
                self.q_size + self.kv_size,
            )
            return self._attend(qkv), residual
        qkv, residual = norm_linear(norm, hidden, residual, self.qkv_proj)
        # q and k side by side, [T, Hq + Hk, D] (a view): Qwen3's head norms and the rotary each run over
        # both at once, one kernel instead of two. v stays a view too: the attention op takes strided rows.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if hasattr(self, "q_norm") and qk.is_cuda and torch.compiler.is_compiling():
            # one Triton kernel for both (Inductor makes two: the norm's rows are read at two offsets by the rotation)
            cos, sin = rope  # traced, the layers take their plain forms: the lookup gave the cos and sin rows
            qk = torch.ops.kiln.qk_norm_rope(
                qk, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads
            )
        else:
            if hasattr(self, "q_norm"):
                qk = self._qk_norm(qk)
            qk = self.rotary_emb.rotate(rope, qk)
        return self._attend(qkv, qk), residual

    def _attend(self, qkv: torch.Tensor, qk: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the projection's q, k (rotated: `qk` [T, Hq + Hk, D], else qkv's own) and v, then o."""
        num_tokens = qkv.shape[0]
        if qk is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "k_scale"):
            # The cache holds k / k_scale and v / v_scale, and attention over them is the same with q times k_scale
            # and the output times v_scale: no kernel needs the scales.
            q, k, v = q * self.k_scale.to(q.dtype), k / self.k_scale.to(k.dtype), v / self.v_scale.to(v.dtype)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        if torch.compiler.is_compiling():  # the op: opaque to Dynamo, where the graph is split
            torch.ops.kiln.unified_attention(q, k, v, out, self.layer_index, self.scale)
        else:
            attend(q, k, v, out, self.layer_index, self.scale)
        if hasattr(self, "v_scale"):
            out = out * self.v_scale.to(out.dtype)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        if self.q_norm.fused:  # eager on the GPU: the Triton kernel on each
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # NOTE (compiled on the CPU; on the GPU the compiled pieces call kiln::qk_norm_rope instead): each head's
        # weight chosen pointwise, not `torch.cat` of the two expanded: Inductor makes a cat a
        # buffer of its own (two kernels a layer, every step), where a `where` folds into the norm's kernel.
        is_k = torch.arange(self.num_heads + self.num_kv_heads, device=qk.device).unsqueeze(1) >= self.num_heads
        return rms_norm(qk, torch.where(is_k, self.k_norm.weight, self.q_norm.weight), self.q_norm.eps)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: TensorParallelShard) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], shard)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, shard)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU, else SiLU

    def forward(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(hidden + residual): (its output, the new residual)."""
        if self.gelu:  # (no one-row kernel has its epilogue: the projection, then the activation, Inductor's)
            gate_up, residual = norm_linear(norm, hidden, residual, self.gate_up_proj)
            return self.down_proj(gelu_tanh_and_mul(gate_up)), residual
        # at batch 1 on the GPU one kernel for the norm, the gate/up matmul and the activation
        act, residual = norm_linear(norm, hidden, residual, self.gate_up_proj, epilogue="silu_mul")
        return self.down_proj(act), residual


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, rotary_emb: RotaryEmbedding, shard: TensorParallelShard
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, rotary_emb, shard)
        self.mlp = SparseMoeBlock(config, shard) if layer_index in config.moe_layers else MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.sandwich_norms:  # Gemma: the attention's and the MLP's outputs normed before the residual add
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # which of the model's rotary lookups this layer's attention takes (Gemma 3's sliding layers: the local one)
        self.local_rope = config.local_rope_of(layer_index)

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sub-block is fused into the next norm (and on the GPU the norm into the
        # projection after it).
        hidden, residual = self.self_attn(rope, self.input_layernorm, hidden, residual)
        if not hasattr(self, "pre_feedforward_layernorm"):
            return self.mlp(self.post_attention_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.mlp(self.pre_feedforward_layernorm, hidden, residual)
        return self.post_feedforward_layernorm(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, shard: TensorParallelShard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        # NOTE: one cos/sin table for all layers (a float32 [max_positions, head_dim] each would be 2 GB for the
        # 8B model at 128k positions), looked up once per forward
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        if config.local_rope_theta:  # Gemma 3's sliding layers: another base (and no scaling)
            self.local_rotary_emb = RotaryEmbedding(
                config.head_dim, max_positions, config.local_rope_theta, config.local_rope_scaling
            )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self._rotary_of(config, i), shard) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.embed_scale
        # the layers whose input states a drafter reads (EAGLE-3: three of them), set before the model is traced
        self.aux_layers: tuple[int, ...] = ()

    def _rotary_of(self, config: ModelConfig, layer: int) -> RotaryEmbedding:
        return self.local_rotary_emb if config.local_rope_of(layer) else self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale != 1.0:  # (Gemma: the scale in the model's dtype, as HF rounds it)
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        rope = self.rotary_emb.lookup(positions, hidden.dtype)
        local = self.local_rotary_emb.lookup(positions, hidden.dtype) if hasattr(self, "local_rotary_emb") else rope
        for index, layer in enumerate(self.layers):
            save_aux_states(self.aux_layers, index, hidden, residual)
            hidden, residual = layer(local if layer.local_rope else rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def save_aux_states(aux_layers: tuple[int, ...], index: int, hidden: torch.Tensor, residual: torch.Tensor | None):
    """EAGLE-3: layer `index`'s input stream, as the layer receives it, into each slot of the states a draft reads
    that names the layer."""
    for slot in (slot for slot, aux in enumerate(aux_layers) if aux == index):
        state = hidden if residual is None else hidden + residual
        if torch.compiler.is_compiling():
            torch.ops.kiln.save_hidden(state, slot)
        else:
            save_hidden(state, slot)


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = DecoderModel  # (a family with layers of its own kind names its model here)
    # Hugging Face projection name -> (Kiln fused parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, max_positions: int | None = None, shard: TensorParallelShard | None = None
    ) -> None:
        super().__init__()
        self.config = config
        shard = shard or TensorParallelShard()
        self.model = self.model_class(config, max_positions or config.max_position_embeddings, shard)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, shard)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank (the LM head gathers the ranks' slices); Gemma 2's
        final soft-cap after it."""
        logits = self.lm_head(hidden)
        if self.config.final_softcap:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits
