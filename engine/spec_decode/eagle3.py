"""EAGLE-3 draft heads (Li et al., 2025) as published: one Llama decoder layer over the target's own states.

    first pass:  h = fc([target layer a | layer b | layer c])          (three layers' input states, [T, 3 H_target])
    every pass:  x = [input_layernorm(embed(token)) | hidden_norm(h)]  ([T, 2 H]: q, k and v read both halves)
                 x = h + attention(x)  ->  prenorm = x + mlp(post_attention_layernorm(x))
                 logits over the draft vocabulary = lm_head(norm(prenorm)); token = argmax + d2t[argmax]
    later passes take the previous pass's prenorm as h (no fc).

Two layouts are read: EAGLE's own (`LlamaForCausalLMEagle3`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: `midlayer.*`,
the aux layers in `eagle_config`) and the speculators library's (`speculators_model_type: "eagle3"`: `layers.0.*`,
the layer's shape in `transformer_layer_config`). The token embedding is the target's unless the draft ships one.
The draft position p holds token p + 1 (it predicts p + 2): its KV cache shares the target's block tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kiln.backends.attention.op import attend
from kiln.engine.config import EngineConfig
from kiln.engine.models.layers import Linear, RMSNorm, RotaryEmbedding, silu_and_mul
from kiln.engine.models.model_dir import model_dir


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None  # None: the target's (2, L // 2, L - 3), as vLLM picks them
    norm_before_residual: bool

    @classmethod
    def read(cls, directory: Path) -> Eagle3Config:
        """From a draft's config.json, in either layout; a checkpoint of neither is one ValueError."""
        raw = json.loads((directory / "config.json").read_text())
        speculators = raw.get("speculators_model_type") is not None
        if speculators:
            if raw["speculators_model_type"] != "eagle3":
                raise ValueError(f"{directory}: speculators_model_type {raw['speculators_model_type']!r} is not eagle3")
            layer = raw["transformer_layer_config"]
            aux = raw.get("eagle_aux_hidden_state_layer_ids")
        elif "LlamaForCausalLMEagle3" in (raw.get("architectures") or []):
            layer = raw
            aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        else:
            raise ValueError(
                f"{directory} is not an EAGLE-3 draft (architectures LlamaForCausalLMEagle3, or a speculators "
                "checkpoint with speculators_model_type eagle3)"
            )
        rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", layer.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = layer["num_attention_heads"]
        hidden = layer["hidden_size"]
        return cls(
            hidden_size=hidden,
            intermediate_size=layer["intermediate_size"],
            num_heads=heads,
            num_kv_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            vocab_size=layer["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            aux_layers=tuple(aux) if aux else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        hidden, dim = config.hidden_size, config.head_dim
        self.q_size, self.kv_size = config.num_heads * dim, config.num_kv_heads * dim
        self.fc = Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv_proj = Linear(2 * hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=False)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.rotary = RotaryEmbedding(dim, max_positions, config.rope_theta, config.rope_scaling)
        self.embed_tokens: nn.Module | None = None  # the target's, unless the checkpoint has one
        self.scale = dim**-0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed state the LM head reads, the state before the norm: the next pass's `hidden`)."""
        embeds = self.input_layernorm(self.embed_tokens(input_ids))
        if self.config.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        qkv = self.qkv_proj(torch.cat([embeds, hidden], dim=-1))
        num_tokens, dim = qkv.shape[0], self.config.head_dim
        qk = self.rotary(positions, qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, dim))
        q, k = qk.split([self.config.num_heads, self.config.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.config.num_kv_heads, dim)
        out = torch.empty(num_tokens, self.config.num_heads, dim, dtype=qkv.dtype, device=qkv.device)
        attend(q.contiguous(), k.contiguous(), v, out, 0, self.scale)  # (the draft's own KV cache, the context's 0th)
        x = self.o_proj(out.view(num_tokens, self.q_size)) + residual
        prenorm = x + self.down_proj(silu_and_mul(self.gate_up_proj(self.post_attention_layernorm(x))))
        return self.norm(prenorm), prenorm

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def first_hidden(self, runner, rows: torch.Tensor) -> torch.Tensor:
        """The first pass's states: fc of the three target layers' states at the step's kept rows."""
        return self.fc(runner.aux_hidden[rows].to(self.fc.weight.dtype))

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft token of each row, in the target's vocabulary."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]


# checkpoint name (either layout, after `midlayer.` / `layers.0.` is dropped) -> (parameter, rows of it it fills)
_STACKED = {
    "self_attn.q_proj.weight": ("qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("qkv_proj.weight", "v"),
    "self_attn.o_proj.weight": ("o_proj.weight", None),
    "mlp.gate_proj.weight": ("gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("down_proj.weight", None),
}


@torch.no_grad()
def load_eagle3(directory: Path, max_positions: int, dtype: torch.dtype, device: torch.device) -> Eagle3Draft:
    """The draft of `directory`'s config and safetensors; every tensor it needs must be there (one ValueError)."""
    config = Eagle3Config.read(directory)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = Eagle3Draft(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    params = dict(draft.named_parameters())
    rows = {
        "q": (0, draft.q_size),
        "k": (draft.q_size, draft.kv_size),
        "v": (draft.q_size + draft.kv_size, draft.kv_size),
    }
    inter = config.intermediate_size
    rows |= {0: (0, inter), 1: (inter, inter)}
    filled, embedding = set(), None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no safetensors weights for the EAGLE-3 draft")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                name = stored.removeprefix("model.").replace("midlayer.", "").replace("layers.0.", "")
                tensor = f.get_tensor(stored)
                if name == "t2d":
                    continue
                if name == "d2t":
                    draft.d2t.copy_(tensor)
                    filled.add(name)
                    continue
                if name == "embed_tokens.weight":
                    embedding = tensor
                    continue
                target, part = _STACKED.get(name, (name, None))
                if target not in params:
                    raise ValueError(f"{path.name}: tensor {stored!r} has no place in an EAGLE-3 draft")
                param = params[target]
                if part is not None:
                    start, size = rows[part]
                    param[start : start + size].copy_(tensor)
                    filled.add(f"{target}:{part}")
                else:
                    param.copy_(tensor)
                    filled.add(target)
    expected = {n for n in params if n not in ("qkv_proj.weight", "gate_up_proj.weight")} | {"d2t"}
    expected |= {f"qkv_proj.weight:{p}" for p in "qkv"} | {"gate_up_proj.weight:0", "gate_up_proj.weight:1"}
    if config.draft_vocab_size == config.vocab_size:
        expected.discard("d2t")  # (a draft over the whole vocabulary needs no map)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"{directory}: the EAGLE-3 draft is missing {missing}")
    if embedding is not None:
        draft.embed_tokens = nn.Embedding(*embedding.shape, device=device, dtype=dtype)
        draft.embed_tokens.weight.copy_(embedding)
    return draft.eval().requires_grad_(False)


def set_target_layers(config: EngineConfig, model: nn.Module) -> Path | None:
    """With an EAGLE-3 draft: set the target layers whose input states it reads (its config's, else vLLM's choice of
    layers 2, L/2 and L - 3) and return the draft's directory; else None. A target Kiln cannot feed refuses."""
    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return None
    draft_dir = model_dir(spec.model, None, config.download_dir)
    if draft_dir is None:
        raise ValueError(f"speculative_config: the EAGLE-3 draft {spec.model!r} is a preset, not a checkpoint")
    draft = Eagle3Config.read(draft_dir)
    target = model.config
    # (a draft attends the whole context: a target with no full-attention layer keeps no KV blocks that hold it; Gemma
    # scales its embedding, which a draft reading the target's embedding was not trained with)
    every_layer_slides = len(target.sliding_layers) == target.num_layers
    scaled = getattr(model.model, "embed_scale", 1.0) != 1.0
    if not hasattr(model.model, "aux_layers") or target.linear_layers or every_layer_slides or scaled:
        raise ValueError(
            f"EAGLE-3 drafts for {target.architecture} are not supported yet: give a Llama-family or gpt-oss model"
        )
    num_layers = target.num_layers
    aux = draft.aux_layers or (2, num_layers // 2, num_layers - 3)
    if len(aux) != 3 or not all(0 <= layer < num_layers for layer in aux):
        raise ValueError(f"the EAGLE-3 draft reads layers {list(aux)}, which a {num_layers}-layer target does not have")
    if draft.target_hidden_size != target.hidden_size or draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE-3 draft {spec.model!r} was made for a target of hidden size {draft.target_hidden_size} and "
            f"vocabulary {draft.vocab_size}, not this model's {target.hidden_size} and {target.vocab_size}"
        )
    model.model.aux_layers = tuple(aux)
    return draft_dir
