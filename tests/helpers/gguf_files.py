"""Small GGUF files written with the `gguf` package's writer from a tiny Hugging Face model, laid out as llama.cpp's
converter lays them out (its tensor names, its metadata keys, its permutation of a Llama's q and k rows, Gemma's norms
stored as 1 + w, the tokenizer's vocabulary and merges), each tensor in a chosen GGUF type.

The `gguf` package quantizes F16, Q8_0 and the legacy types but not the k-quants: a Q4_K or Q6_K tensor is written as
random blocks with small finite scales (the readers under test dequantize the same bytes, so the test compares their
loads of one file, whatever the values).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
M = gguf.MODEL_TENSOR
# Hugging Face name (in a layer) -> GGUF tensor kind; Gemma's ffn_norm is the norm before its MLP
_LAYER = {
    "input_layernorm": M.ATTN_NORM,
    "self_attn.q_proj": M.ATTN_Q,
    "self_attn.k_proj": M.ATTN_K,
    "self_attn.v_proj": M.ATTN_V,
    "self_attn.o_proj": M.ATTN_OUT,
    "self_attn.q_norm": M.ATTN_Q_NORM,
    "self_attn.k_norm": M.ATTN_K_NORM,
    "post_attention_layernorm": M.FFN_NORM,
    "mlp.gate_proj": M.FFN_GATE,
    "mlp.up_proj": M.FFN_UP,
    "mlp.down_proj": M.FFN_DOWN,
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": M.ATTN_POST_NORM,
    "pre_feedforward_layernorm": M.FFN_NORM,
    "post_feedforward_layernorm": M.FFN_POST_NORM,
}
_LAYER |= {
    "mlp.gate": M.FFN_GATE_INP,
    "mlp.shared_expert.gate_proj": M.FFN_GATE_SHEXP,
    "mlp.shared_expert.up_proj": M.FFN_UP_SHEXP,
    "mlp.shared_expert.down_proj": M.FFN_DOWN_SHEXP,
    "mlp.shared_expert_gate": M.FFN_GATE_INP_SHEXP,
}
_GLOBAL = {"model.embed_tokens": M.TOKEN_EMBD, "model.norm": M.OUTPUT_NORM, "lm_head": M.OUTPUT}
_EXPERTS = {"gate_proj": M.FFN_GATE_EXP, "up_proj": M.FFN_UP_EXP, "down_proj": M.FFN_DOWN_EXP}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def tiny_config(arch: str, num_layers: int = 2):
    """A tiny config whose every field a GGUF file carries (or transformers' GGUF reader defaults to the same value):
    rows of 256 columns, the k-quants' block."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    shape = dict(vocab_size=512, hidden_size=256, intermediate_size=256, rms_norm_eps=1e-6)
    shape |= dict(num_hidden_layers=num_layers)
    shape |= dict(max_position_embeddings=512, bos_token_id=0, eos_token_id=511, initializer_range=0.1)
    if arch == "llama":
        return LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "qwen3":  # (transformers reads no head size from a qwen3 file: its config's 128 is what it keeps)
        return Qwen3Config(
            **shape, num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=True
        )
    if arch == "qwen2":
        return Qwen2Config(**shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    # (transformers reads no expert sizes from a file: its config classes' defaults are what it keeps)
    if arch == "qwen3moe":
        heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
        return Qwen3MoeConfig(**shape, **heads, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen2moe":
        return Qwen2MoeConfig(
            **shape, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2
        )
    if arch == "gemma2":
        heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256)
        return Gemma2Config(**shape, **heads, sliding_window=8)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **shape,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=256,
        )
    raise ValueError(arch)


def make_hf_model(path: Path, arch: str, num_layers: int = 2) -> Path:
    """The tiny model, random weights (norms too, so Gemma's 1 + w matters), saved with a tokenizer."""
    from transformers import AutoModelForCausalLM

    from kiln.engine.text.tokenizer import builtin_tokenizer

    torch.manual_seed(0)
    config = tiny_config(arch, num_layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if arch.startswith("gemma") else 1.0))
            elif name.endswith("bias"):  # (zero at init)
                p.normal_(0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # decisive routers: a near-tie says nothing about the loader
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    builtin_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def write_gguf(model_dir: Path, out: Path, arch: str, types: dict[str, T], default: T = T.F32) -> Path:
    """`model_dir`'s model as a GGUF file of architecture `arch`; `types` maps a substring of a GGUF tensor name
    (e.g. "attn_q", "ffn_down", "token_embd") to its type, `default` for the rest (norms stay F32, as llama.cpp's)."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    state = load_file(model_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, arch, config)
    _write_tokenizer(writer, model_dir, config)
    layer_names = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        if match := _EXPERT.fullmatch(name):
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = tensor.float().numpy()
            continue
        base, _, suffix = name.rpartition(".")
        local = None
        if base.startswith("model.layers."):
            index, local = base.removeprefix("model.layers.").split(".", 1)
            gguf_name = gguf.TENSOR_NAMES[layer_names[local]].format(bid=int(index))
        else:
            gguf_name = gguf.TENSOR_NAMES[_GLOBAL[base]]
        data = tensor.float().numpy()
        if arch == "llama" and local in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if local.endswith("q_proj") else config["num_key_value_heads"]
            data = _permute(data, heads)
        if arch.startswith("gemma") and base.endswith("norm"):
            data = data + 1.0
        if base.endswith("shared_expert_gate"):
            data = data[0]  # (llama.cpp writes the one row as a vector)
        _add(writer, f"{gguf_name}.{suffix}", data, _type_of(gguf_name, data, types, default))
    for (layer, proj), by_expert in sorted(experts.items()):  # stacked [experts, out, in], as llama.cpp stores them
        gguf_name = gguf.TENSOR_NAMES[_EXPERTS[proj]].format(bid=layer)
        data = np.stack([by_expert[e] for e in sorted(by_expert)])
        _add(writer, f"{gguf_name}.weight", data, _type_of(gguf_name, data, types, default))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _type_of(gguf_name: str, data: np.ndarray, types: dict[str, T], default: T) -> T:
    return T.F32 if data.ndim == 1 else next((t for key, t in types.items() if key in gguf_name), default)


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_float32(f"{arch}.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        local = (rope.get("sliding_attention") or {}).get("rope_theta")
        if local is not None:
            writer.add_rope_freq_base_swa(float(local))
        full = rope.get("full_attention") or {}
        writer.add_rope_freq_base(float(full.get("rope_theta", 1e6)))


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    """The byte-level BPE as llama.cpp writes a GPT-2-style tokenizer: every id's token (unused ids padded), types,
    merges."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    special = {t["id"] for t in tokenizer["added_tokens"]}
    by_id = {i: token for token, i in vocab.items()}
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
        for i in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a head's rows: its rotary halves interleaved in pairs."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, kind: T) -> None:
    if kind in (T.F32, T.F16):
        writer.add_tensor(name, data.astype(np.float32 if kind == T.F32 else np.float16))
    elif kind in (T.Q4_K, T.Q6_K):
        writer.add_tensor(name, _random_kquant(data.shape, kind), raw_dtype=kind)
    else:  # (the quantized rows' bytes; the writer works out the values' shape from them)
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


def _random_kquant(shape: tuple[int, ...], kind: T) -> np.ndarray:
    """Random blocks of a k-quant with small finite float16 scales (d and dmin): weights of about 0.05."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    *rows, columns = shape
    rng = np.random.default_rng(sum(rows) * 7919 + columns * 31 + int(kind))
    blocks = rng.integers(0, 256, size=(*rows, columns // block_values, block_bytes), dtype=np.uint8)
    if kind == T.Q4_K:  # d, dmin lead the block
        blocks[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(5e-5).tobytes(), np.uint8)
    else:  # Q6_K: d ends the block
        blocks[..., -2:] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(*rows, -1)
