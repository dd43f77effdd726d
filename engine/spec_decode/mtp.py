"""Multi-token prediction drafts: the MTP layer Qwen3.5/3.6 and Qwen3-Next ship beside the model (`mtp.*`).

    x = fc([pre_fc_norm_embedding(embed(token)) | pre_fc_norm_hidden(h)])     ([T, 2H] -> [T, H])
    h' = norm(decoder layer(x))       (a full-attention layer as the model's own: gated, q/k normed, partial RoPE)
    token = argmax(lm_head(h'))       (the model's embedding and LM head)

The first pass's h is the model's last hidden state at each position, later passes take the layer's own h'. As with
EAGLE-3 (eagle_proposer.py, which runs either), position p reads token p + 1 and the layer keeps its own KV cache
over the model's blocks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import Linear, RMSNorm
from kiln.engine.models.loader import checkpoint_tensors, expected_parts, load_tensor, place_of
from kiln.engine.models.parallel import TensorParallelShard
from kiln.engine.models.qwen3_5 import HybridDecoderLayer, Qwen3_5ForCausalLM


class MtpDraft(nn.Module):
    stacked_params = Qwen3_5ForCausalLM.stacked_params

    def __init__(self, config: ModelConfig, target: Qwen3_5ForCausalLM) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        # (a full-attention layer, sparse in a mixture of experts: its index past the model's layers)
        moe = config.moe_layers + (config.num_layers,) if config.moe_layers else ()
        layer_config = dataclasses.replace(config, moe_layers=moe)
        self.layer = HybridDecoderLayer(layer_config, config.num_layers, 0, TensorParallelShard())
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self._target = [target]  # (not a submodule: its weights are the model's)
        # with tensor parallelism (the draft on rank 0), the whole vocabulary's embedding and LM head (engine_core.py)
        self.embed_tokens: nn.Module | None = None
        self.lm_head_weight: torch.Tensor | None = None
        attention = self.layer.self_attn
        self.num_kv_heads, self.head_dim = attention.num_kv_heads, attention.head_dim

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state the LM head reads, the next pass's `hidden`: the same)."""
        target = self._target[0].model
        embed = self.embed_tokens if self.embed_tokens is not None else target.embed_tokens
        embeds = self.pre_fc_norm_embedding(embed(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = target.cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
        x, residual = self.layer(rope, x, None)
        out, _ = self.norm(x, residual)
        return out, out

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        if self.lm_head_weight is not None:
            return torch.nn.functional.linear(normed, self.lm_head_weight).argmax(dim=-1)
        return self._target[0].compute_logits(normed).argmax(dim=-1)

    def first_hidden(self, runner, rows: torch.Tensor) -> torch.Tensor:
        """The first pass's states: the model's last hidden state at the step's kept rows."""
        return runner.last_hidden[rows]


@torch.no_grad()
def load_mtp(
    model_dir: Path, load_format: str, config: ModelConfig, target: Qwen3_5ForCausalLM, dtype, device
) -> MtpDraft:
    """The MTP layer from the model's own checkpoint (its `mtp.*` tensors); a checkpoint without them is one
    ValueError."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = MtpDraft(config, target)
    finally:
        torch.set_default_dtype(default_dtype)
    filled = set()
    for file_name, stored, source in checkpoint_tensors(model_dir, config, load_format):
        if not stored.startswith(("mtp.", "model.mtp.")):
            continue
        name = stored.removeprefix("model.").removeprefix("mtp.").replace("layers.0.", "layer.")
        name = name.replace("layer.linear_attn.", "layer.self_attn.")
        if name.startswith("layers."):
            raise ValueError(f"{model_dir}: {stored!r}: Kiln reads one MTP layer (mtp.layers.0)")
        target, shard = place_of(draft, name)
        load_tensor(draft, target, shard, source, f"{file_name}: tensor {stored!r}")
        filled.add((target, shard))
    missing = sorted(str(part) for part in set(expected_parts(draft)) - filled)
    if not filled:
        raise ValueError(f"{model_dir} has no multi-token-prediction layer (mtp.*) for speculative_config method mtp")
    if missing:
        raise ValueError(f"{model_dir}: the MTP layer is missing {missing[:5]}")
    if config.norm_weight_offset:  # (its norms scale by 1 + weight, as the model's)
        for module in draft.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(config.norm_weight_offset)
    return draft.eval().requires_grad_(False)
