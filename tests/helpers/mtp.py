"""A tiny Qwen3.5 checkpoint with the multi-token-prediction layer Qwen ships beside the model (`mtp.*`), and what
that layer proposes, computed with transformers' own decoder layer and rotary embedding (the MTP wiring — norms, fc,
one full-attention layer, norm, the model's LM head — from the published checkpoints' tensors)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_mtp_layer(model_dir: Path, path: Path, seed: int = 0) -> Path:
    """A copy of the tiny Qwen3.5 at `path` with a random `mtp.*` layer (a full-attention decoder layer's shapes)."""
    shutil.copytree(model_dir, path)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    attention = 3  # (the tiny model's full-attention layer gives the shapes)
    for name, tensor in list(weights.items()):
        prefix = f"model.layers.{attention}."
        if name.startswith(prefix):
            values = torch.randn(tensor.shape, generator=generator) * (0.3 if "norm" in name else 0.2)
            weights["mtp.layers.0." + name.removeprefix(prefix)] = values
    hidden = weights["model.norm.weight"].shape[0]
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.3
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def reference_mtp_drafts(model_dir: Path, prompt: list[int], next_token: int, k: int) -> list[int]:
    """The k greedy drafts the MTP layer makes after `prompt` + `next_token` (float32, whole recomputes)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mtp = {
        k.removeprefix("mtp."): v for k, v in load_file(model_dir / "model.safetensors").items() if k.startswith("mtp.")
    }
    layer = Qwen3_5DecoderLayer(config, 3).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in mtp.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].weight.data = mtp[f"{name}.weight"]
    rotary = Qwen3_5TextRotaryEmbedding(config)
    with torch.no_grad():
        hidden = list(hf.model(torch.tensor([prompt])).last_hidden_state[0])
        tokens = prompt[1:] + [next_token]
        drafts = []
        for _ in range(k):
            embeds = norms["pre_fc_norm_embedding"](hf.model.embed_tokens(torch.tensor(tokens)))
            x = torch.cat([embeds, norms["pre_fc_norm_hidden"](torch.stack(hidden))], -1) @ mtp["fc.weight"].T
            length = len(tokens)
            mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
            positions = torch.arange(length)[None]
            cos_sin = rotary(x[None], positions)
            out = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
            out = norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
            drafts.append(int(hf.lm_head(out[-1]).argmax()))
            tokens.append(drafts[-1])
            hidden.append(out[-1])
    return drafts
